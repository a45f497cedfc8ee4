"""A replaced hop's input history, regrouped into prefill chunks for its replacement.

A hop's history is the frames it was sent, in order and contiguous from position 0: the
prompt's prefill chunks, then one single-token frame per decode step. Replaying it call by
call would cost one round trip per past token; :func:`rechunk` instead joins consecutive
frames and cuts them into chunks of ``chunk_tokens`` positions, so a history of ``T`` tokens
is replayed in ``ceil(T / chunk_tokens)`` calls. The replacement's KV cache holds the same
keys and values for the same positions: causal attention over a cache does not depend on
where the chunk boundaries fall (tests/unit/test_shard.py checks chunked against one-shot).
"""

from __future__ import annotations

from typing import AsyncIterator, Iterable

from meshnet.dataplane.codec import Activation, ActivationCodec


async def rechunk(history: Iterable[tuple[int, bytes, int]], codec: ActivationCodec,
                  chunk_tokens: int) -> AsyncIterator[tuple[int, bytes, int]]:
    """Yield ``(position, frame, tokens)`` chunks of ``chunk_tokens`` tokens (the last may be
    shorter) holding the same activations as ``history``'s ``(position, frame, tokens)`` entries.

    A frame that already is a whole chunk on a chunk boundary is passed on as is; the others
    are decoded, joined and encoded again with ``codec`` (lossless: same wire dtype).

    Raises:
        ValueError: ``chunk_tokens`` < 1, or the history is not contiguous (a gap or an overlap).
        meshnet.errors.WireError: a stored frame does not decode.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    pending: list[Activation] = []
    pending_tokens, start = 0, None  # start: position of the first pending token
    for position, frame, tokens in history:
        if start is not None and position != start + pending_tokens:
            raise ValueError(f"history is not contiguous: position {position} after {start + pending_tokens}")
        if start is None:
            start = position
        if not pending and tokens == chunk_tokens:
            yield position, frame, tokens
            start = position + tokens
            continue
        pending.append(await codec.decode(frame))
        pending_tokens += tokens
        if pending_tokens < chunk_tokens:
            continue
        pieces = codec.split(codec.concat(pending), chunk_tokens)
        rest = pending_tokens % chunk_tokens
        full, pending = (pieces[:-1], pieces[-1:]) if rest else (pieces, [])
        for piece in full:
            yield start, await codec.encode(piece), chunk_tokens
            start += chunk_tokens
        pending_tokens = rest
    if pending:
        yield start, await codec.encode(codec.concat(pending)), pending_tokens


async def cut_history(history: list[tuple], position: int, codec: ActivationCodec) -> list[tuple]:
    """``history``'s entries ``(position, frame, tokens, ...)`` up to ``position``: the positions
    from ``position`` on (a speculative step's rejected drafts, ADR-0058) are forgotten, so a
    failover replays only what the hops still hold. An entry that straddles ``position`` keeps its
    first positions, its frame decoded, cut and encoded again with ``codec`` (lossless: same wire
    dtype); any further fields of an entry are kept as they are.

    Raises:
        meshnet.errors.WireError: the straddling entry's frame does not decode.
    """
    kept = []
    for entry in history:
        start, frame, tokens = entry[0], entry[1], entry[2]
        if start + tokens <= position:
            kept.append(entry)
        elif start < position:
            head = codec.split(await codec.decode(frame), position - start)[0]
            kept.append((start, await codec.encode(head), position - start, *entry[3:]))
    return kept
