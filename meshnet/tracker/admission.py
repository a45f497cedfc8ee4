"""Admission by evidence: a shard is routed only after the tracker has checked it (ADR-0042).

A node's capability report says its shard works; it no longer decides alone. For each passed
report (a new doctor run gives a new report, so a reload is checked again) the tracker gives
the shard a **verification**:

- ``rejected``: its weights digest differs from the one the tracker knows for that model, range
  and recipe, or its output on a challenge differed from the reference holders' beyond the
  recipes' tolerance. Never admitted; the evidence is shown in ``GET /v1/nodes``.
- ``pending``: a challenge is running. Not admitted yet (a fraction of a second on a 16-token probe
  against a holder; 1-3 s against the model's files, which the tracker runs layer by layer).
- ``failed``: the candidate's challenge call failed (refused, timed out, an error status): not
  admitted; the next heartbeat brings a new challenge.
- ``verified``: its output on a challenge it could not predict (hidden states from a random seed:
  where the model's files are readable, those a prompt of random tokens makes at the range's first
  layer, in the wire's bfloat16; sent through the ordinary ``POST /v1/forward`` under a fresh
  session whose ticket names an entry as a node's default id, :func:`pseudo_entry`) agreed with
  the model's own files (the tracker computes the reference itself where this host holds them,
  :class:`ReferenceSource`, ADR-0070), or else with an admitted holder of the same layers.
- ``unverified``: there is nothing to compare it with (the first holder of a range when the
  tracker cannot read the model's files, a model without a known width): admitted, so a fresh
  mesh becomes ready at once, and marked so in routes; its digest becomes the one later holders
  must match.

When a candidate disagrees with a holder reference and another admitted holder exists, that one
runs the challenge too and the majority decides; an outvoted reference is quarantined on the
tracker's own evidence. The model's files are not outvoted: a candidate they disagree with is
rejected. :func:`decide` is the pure decision; :func:`run_challenge` the calls.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.layers import LayerRange
from meshnet.dataplane.evidence import challenge_frame, frame_distance, tolerance
from meshnet.dataplane.frames import HEADER_REWIND, read_array
from meshnet.protocol.route import Hop
from meshnet.protocol.signing import encode_public_key, sign_request
from meshnet.protocol.tickets import HEADER_TICKET, TicketClaims, issue_ticket

__all__ = ["ADMITTING", "CHALLENGE_TOKENS", "SOURCE", "Challenge", "ReferenceSource", "Verdict",
           "decide", "pseudo_entry", "run_challenge", "run_steps"]

log = logging.getLogger(__name__)

#: verifications that count toward coverage and routes
ADMITTING = ("verified", "unverified")
#: tokens in a challenge's hidden states
CHALLENGE_TOKENS = 16
#: the reference a verdict names when the model's own files were the reference (never a node id)
SOURCE = "@source"


class ReferenceSource(Protocol):
    """What computes a challenge's reference from a model's own files (ADR-0070). The tracker holds
    one where its host can read models (``meshnet tracker start --source-references``); the
    implementation lives with the node's model code (:class:`meshnet.node.reference.SourceReferences`),
    which the tracker never imports."""

    def holds(self, model: str) -> bool:
        """Whether references of ``model`` can be computed here (cheap: called on the event loop)."""

    async def run(self, model: str, layers: LayerRange, quantization: str, compute_dtype: str,
                  frame: bytes) -> bytes:
        """The output frame (float32 ``[1, tokens, hidden]``) of ``layers`` of ``model`` in that recipe on
        ``frame`` (float32 ``[1, tokens, hidden]`` hidden states at position 0).

        Raises:
            Exception: the files could not be read or the layers not run (the caller falls back to holders).
        """

    async def challenge_input(self, model: str, start: int, tokens: int, seed: int) -> bytes:
        """A challenge's input frame for a range from layer ``start``: the hidden states a real prefill
        of ``tokens`` token ids drawn from ``seed`` would carry there, in the wire dtype entries send.

        Raises:
            Exception: as :meth:`run` (the caller falls back to standard-normal hidden states).
        """


@dataclass(frozen=True)
class Verdict:
    """One shard's verification: ``state`` (``pending``/``verified``/``unverified``/``rejected``),
    why, and the evidence (reference node ids, distances, tolerance) when a challenge ran."""

    state: str
    reason: str = ""
    references: tuple[str, ...] = ()
    distances: dict[str, float] = field(default_factory=dict)
    tolerance: float | None = None
    at: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        out = {"state": self.state, "reason": self.reason}
        if self.references:
            out.update(references=list(self.references), distances=dict(self.distances), tolerance=self.tolerance)
        return out


@dataclass(frozen=True)
class Holder:
    """A node holding a shard, as admission sees it: ``recipe`` is quantization/compute dtype."""

    node_id: str
    endpoint: str
    layers: LayerRange
    quantization: str
    compute_dtype: str


@dataclass(frozen=True)
class Challenge:
    """A challenge to run: ``candidate`` against ``references`` (in order; the second only on a
    disagreement) over ``layers`` of ``model``, with hidden states of width ``hidden_size``."""

    model: str
    layers: LayerRange
    candidate: Holder
    references: tuple[Holder, ...]
    hidden_size: int
    key: tuple = ()
    #: run against the model's own files first (:class:`ReferenceSource`); ``references`` only where that fails
    source: bool = False


def digest_key(model: str, layers: LayerRange, quantization: str, compute_dtype: str) -> tuple:
    """What a weights digest is known for: one model, one exact range, one recipe."""
    return (model, layers.start, layers.end, quantization, compute_dtype)


def decide(candidate: Holder, digest: str, known_digest: str | None, holders: list[Holder],
           hidden_size: int | None, trusted: frozenset[str] = frozenset(),
           source: bool = False) -> Verdict | tuple[Holder, ...]:
    """The verification of a candidate shard without a network call, or the references to
    challenge it against.

    Args:
        candidate: the node and shard to admit; ``digest`` its reported weights digest.
        known_digest: the digest the tracker knows for the same model, range and recipe (None: none yet).
        holders: admitted holders of the model (verified or unverified, not quarantined, the
            candidate excluded).
        hidden_size: the model's activation width (None: unknown, no challenge possible).
        trusted: node ids the operator trusts (ADR-0069): such a candidate is verified on the
            operator's word, its digest whatever was known; such holders are references first.
        source: the tracker can compute a reference from the model's own files (ADR-0070): the
            candidate is challenged even with no holder to compare it with.

    Returns:
        A final :class:`Verdict` (``verified`` for a trusted candidate, ``rejected`` or
        ``unverified``), or up to two references: admitted holders whose shard covers the
        candidate's layers with the same recipe (quantization and compute dtype: holders of other
        recipes differ honestly by more than one tolerance, ADR-0042), trusted ones first; with
        ``source``, possibly none (the challenge then runs against the files alone).
    """
    if candidate.node_id in trusted:
        return Verdict("verified", "trusted by the operator (meshnet trust)")
    if known_digest and digest and digest != known_digest:
        return Verdict("rejected", f"weights digest {digest} differs from {known_digest}, which the tracker "
                                   "knows for this model, range and recipe")
    covering = sorted((h for h in holders
                       if h.layers.start <= candidate.layers.start and candidate.layers.end <= h.layers.end
                       and (h.quantization, h.compute_dtype) == (candidate.quantization, candidate.compute_dtype)),
                      key=lambda h: (h.node_id not in trusted, h.node_id))
    if not hidden_size or not (covering or source):
        why = ("no other admitted holder of this recipe covers these layers" if hidden_size
               else "the model's activation width is unknown")
        return Verdict("unverified", f"admitted without a challenge: {why}")
    return tuple(covering[:2])


def pseudo_entry() -> tuple[str, Ed25519PrivateKey]:
    """A fresh entry id and key for one of the tracker's own sessions (a challenge, a speed probe, an
    audit's re-run): the id has the form of a node's default id (``node-`` and 8 hex digits,
    :func:`meshnet.node.settings.new_node_id`) and the key is new, so the session ticket does not
    tell the node that the tracker is asking (it once named ``@tracker`` and carried the tracker's
    own key, which every node knows)."""
    return f"node-{secrets.token_hex(4)}", Ed25519PrivateKey.generate()


def _ticket(key: Ed25519PrivateKey, session: str, model: str, hop: Hop, ttl_s: float,
            entry: tuple[str, Ed25519PrivateKey]) -> str:
    claims = TicketClaims.for_route(session=session, model=model, entry=entry[0],
                                    entry_key=encode_public_key(entry[1].public_key()), hops=[hop], ttl_s=ttl_s)
    return issue_ticket(key, claims)


async def _run_on(http: httpx.AsyncClient, key: Ed25519PrivateKey, holder: Holder, model: str, layers: LayerRange,
                  frame: bytes, timeout_s: float) -> bytes:
    """The challenge on one holder: one forward call under a fresh session. Raises on any failure."""
    return (await run_steps(http, key, holder, model, layers, [(0, frame, False)], timeout_s))[0]


async def run_steps(http: httpx.AsyncClient, key: Ed25519PrivateKey, holder: Holder, model: str, layers: LayerRange,
                    steps: list[tuple[int, bytes, bool]], timeout_s: float,
                    times: list[float] | None = None) -> list[bytes]:
    """Run ``steps`` (``(position, frame, rewind)``: one session's history from position 0, a
    speculative step taking the session back to its position first) through ``holder``'s
    ``layers`` as one fresh session (ticket signed by the tracker for a :func:`pseudo_entry`),
    every position returned, then release it signed as that entry. ``timeout_s`` bounds each call; ``times``, when
    given, receives each call's seconds (request sent to response read), in order.

    Returns:
        The output frames, one per step, in order.

    Raises:
        Any failure of a call (refused, timed out, an error status).
    """
    session = uuid.uuid4().hex
    hop = Hop(holder.node_id, holder.endpoint, layers)
    entry = pseudo_entry()
    ticket = _ticket(key, session, model, hop, ttl_s=max(60.0, 4 * timeout_s, timeout_s * len(steps)), entry=entry)
    start, end = layers.to_inclusive()
    outputs = []
    try:
        for position, frame, rewind in steps:
            headers = {"X-Meshnet-Model": model, "X-Meshnet-Session": session, "X-Meshnet-Start-Layer": str(start),
                       "X-Meshnet-End-Layer": str(end), "X-Meshnet-Position": str(position), HEADER_TICKET: ticket,
                       "Content-Type": "application/octet-stream", **({HEADER_REWIND: "1"} if rewind else {})}
            t0 = time.perf_counter()
            async with asyncio.timeout(timeout_s):
                resp = await http.post(f"{holder.endpoint}/v1/forward", content=frame, headers=headers,
                                       timeout=timeout_s)
            if times is not None:
                times.append(time.perf_counter() - t0)
            resp.raise_for_status()
            outputs.append(resp.content)
        return outputs
    finally:
        path = f"/v1/sessions/{session}"
        signed = sign_request(entry[1], entry[0], "DELETE", path, b"")
        try:
            async with asyncio.timeout(5.0):
                await http.delete(f"{holder.endpoint}{path}", headers={HEADER_TICKET: ticket, **signed}, timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort: the session expires by its TTL
            pass


async def run_challenge(http: httpx.AsyncClient, key: Ed25519PrivateKey, challenge: Challenge,
                        timeout_s: float = 30.0,
                        reference: ReferenceSource | None = None) -> tuple[Verdict, str | None]:
    """Run ``challenge``: random hidden states through the candidate (with ``challenge.source`` and a
    ``reference``, those a prompt of random tokens makes at its first layer, ADR-0070; else
    standard-normal ones), then through the model's own files: within the tolerance it is
    verified, beyond it rejected. Where the files cannot be run (or without them), through its
    first holder reference; on a disagreement, through the second too, and the majority decides.

    Returns:
        ``(verdict of the candidate, node id of a reference the vote outvoted or None)``. A
        candidate whose call fails (refused, timed out, an error status, no frame) is ``failed``:
        not admitted, and challenged again at its next heartbeat; a reference that does not
        answer leaves the candidate ``unverified`` (nothing to compare with).
    """
    c = challenge.candidate
    seed, frame = secrets.randbits(63), None
    if challenge.source and reference is not None:  # hidden states like a real prompt's (ADR-0070)
        try:
            frame = await reference.challenge_input(challenge.model, challenge.layers.start, CHALLENGE_TOKENS, seed)
        except Exception as exc:  # noqa: BLE001 - unreadable files: standard-normal hidden states then
            log.warning("no challenge input from the files of %s (%s: %s)", challenge.model, type(exc).__name__, exc)
    frame = frame or challenge_frame(seed, CHALLENGE_TOKENS, challenge.hidden_size)
    try:
        out = await _run_on(http, key, c, challenge.model, challenge.layers, frame, timeout_s)
        read_array(out)
    except Exception as exc:  # noqa: BLE001 - refused, timed out, an error answer, not a frame: no evidence of working
        return Verdict("failed", f"the challenge on {c.node_id} failed: {type(exc).__name__}: {exc}"[:500]), None
    if challenge.source and reference is not None:
        try:
            ref_out = await reference.run(challenge.model, challenge.layers, c.quantization, c.compute_dtype, frame)
            read_array(ref_out)
        except Exception as exc:  # noqa: BLE001 - unreadable files, a missing tensor: the holders decide
            log.warning("no reference from the files of %s layers %s (%s: %s); holders decide", challenge.model,
                        challenge.layers, type(exc).__name__, exc)
        else:
            limit = tolerance(c.quantization, c.compute_dtype)
            distance = round(frame_distance(out, ref_out), 6)
            evidence = ((SOURCE,), {f"{c.node_id}|{SOURCE}": distance}, limit)
            if distance <= limit:
                return Verdict("verified", f"challenge output within {limit} of the model's own files'",
                               *evidence), None
            return Verdict("rejected", f"challenge output differs from the model's own files' beyond {limit}",
                           *evidence), None
    distances: dict[str, float] = {}
    answered: list[tuple[Holder, bytes]] = []
    for ref in challenge.references:
        try:
            ref_out = await _run_on(http, key, ref, challenge.model, challenge.layers, frame, timeout_s)
            read_array(ref_out)
        except Exception:  # noqa: BLE001 - the reference failed or sent no frame: try the next
            continue
        limit = tolerance(c.quantization, c.compute_dtype, ref.quantization, ref.compute_dtype)
        distances[f"{c.node_id}|{ref.node_id}"] = round(frame_distance(out, ref_out), 6)
        answered.append((ref, ref_out))
        refs = tuple(r.node_id for r, _ in answered)
        if distances[f"{c.node_id}|{ref.node_id}"] <= limit:
            outvoted = None
            if len(answered) == 2:  # the first reference disagreed: outvoted when it disagrees with this one too
                (first, first_out), _ = answered
                between = frame_distance(first_out, ref_out)
                distances[f"{first.node_id}|{ref.node_id}"] = round(between, 6)
                outvoted = first.node_id if between > limit else None
            return Verdict("verified", f"challenge output within {limit} of {ref.node_id}'s", refs, distances,
                           limit), outvoted
    if not answered:
        return Verdict("unverified", "admitted without a challenge: no reference holder answered"), None
    refs = tuple(r.node_id for r, _ in answered)
    limit = tolerance(c.quantization, c.compute_dtype, *(r.quantization for r, _ in answered))
    return Verdict("rejected", f"challenge output differs from {' and '.join(refs)}'s beyond {limit}", refs,
                   distances, limit), None
