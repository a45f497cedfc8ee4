"""The KV caches a shard's attention reads and writes.

- :class:`KVCache` keeps one session's keys and values for the layers of one shard, grown in
  blocks so a decode step copies nothing (ADR-0052), and goes back a few positions for a
  speculative step's rejected drafts (ADR-0058).
- :class:`BatchCache` and :class:`RaggedKV` let a batch of sessions of different lengths run as
  one forward, each row over its own cache; :class:`PackedCache` packs steps of one or a few
  positions of several sessions into one row (ADR-0058).
"""

from __future__ import annotations

import torch

from meshnet.models.states import BatchLinearStates, LinearStates


#: tokens a KV-cache buffer grows by when it is full (ADR-0052): one copy of the cache every this many tokens
KV_BLOCK_TOKENS = 128
#: most positions a session may be rewound by (a speculative step's rejected drafts, ADR-0058); a
#: sliding-window layer keeps this many positions beyond its window so a rewind never reaches
#: past what it dropped
MAX_REWIND = 32


class KVCache(LinearStates):
    """Per-session key/value cache for the layers of one shard, stored without per-token copies.

    Duck-types the ``update(key, value, layer_idx, ...)`` call transformers' attention modules
    make. Per layer it holds one buffer each for keys and values, ``[batch, kv_heads, capacity,
    head_dim]`` in the compute dtype, of which the first ``lengths[layer]`` positions are filled.
    The first update sizes the buffers to its own tokens; when a later update does not fit, the
    buffers are reallocated with room for ``block_tokens`` more positions and the filled part is
    copied once. A decode step therefore writes one position in place, and the cache is
    copied once every ``block_tokens`` tokens, never once per token. A sliding-window layer
    (``windows``) keeps only its last ``window`` positions when its buffers are reallocated, so
    it holds at most ``window + block_tokens`` positions plus one chunk, whatever the context
    (``window + MAX_REWIND`` are kept, so a rewind by up to :data:`MAX_REWIND` positions leaves
    the window whole).

    Args:
        block_tokens: positions added when a buffer grows (> 0).
    """

    def __init__(self, block_tokens: int = KV_BLOCK_TOKENS) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = block_tokens
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: dict[int, int] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        #: sliding-window layers' windows (positions), set by the shard that runs the session
        self.windows: dict[int, int] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[batch, kv_heads, seq, head_dim]`` to layer
        ``layer_idx``; returns every cached key and value of that layer (views, no copy)."""
        length = self.lengths.get(layer_idx)
        window = self.windows.get(layer_idx)
        if length is None:  # exactly the first chunk's size: a one-shot prefill leaves no slack
            # a chunk longer than a sliding layer's window attends to all of itself, and only its
            # last ``window`` positions are kept for the queries after it
            kept = window if window is not None and key_states.dim() > 1 and key_states.shape[-2] > window else None
            first = (key_states, value_states) if kept is None else (key_states[..., -kept:, :],
                                                                      value_states[..., -kept:, :])
            keys, values = (t.clone(memory_format=torch.contiguous_format) for t in first)
            self.keys[layer_idx], self.values[layer_idx] = keys, values
            self.lengths[layer_idx] = kept or (key_states.shape[-2] if key_states.dim() > 1 else key_states.numel())
            return (keys, values) if kept is None else (key_states, value_states)
        new = key_states.shape[-2]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if length + new > keys.shape[-2]:
            keys, values = self._grow(layer_idx, length, length + new)
            length = self.lengths[layer_idx]
        keys[..., length:length + new, :].copy_(key_states)
        values[..., length:length + new, :].copy_(value_states)
        self.lengths[layer_idx] = length = length + new
        return keys[..., :length, :], values[..., :length, :]

    def _grow(self, layer_idx: int, length: int, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reallocate layer ``layer_idx``'s buffers for ``needed`` positions plus a block; a
        sliding-window layer moves only its last ``window`` positions (what later queries can
        see) to the front of the new buffers, the rest is dropped."""
        window = self.windows.get(layer_idx)
        keep = length if window is None else min(length, window + MAX_REWIND)
        capacity = needed - length + keep + self.block_tokens
        grown = []
        for store in (self.keys, self.values):
            old = store[layer_idx]
            buffer = old.new_empty((*old.shape[:-2], capacity, old.shape[-1]))
            buffer[..., :keep, :].copy_(old[..., length - keep:length, :])
            store[layer_idx] = buffer
            grown.append(buffer)
        self.lengths[layer_idx] = keep
        return grown[0], grown[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached for layer ``layer_idx`` (0 when it holds none)."""
        return self.lengths.get(layer_idx, 0)

    def rewind(self, positions: int) -> None:
        """Forget the last ``positions`` cached positions of every layer (a speculative step's
        rejected drafts, ADR-0058); the buffers stay, later updates overwrite them.

        Raises:
            ValueError: ``positions`` is negative or over :data:`MAX_REWIND`, a layer holds fewer
                positions, or the cache holds linear-attention states (they keep no per-position
                history to go back to).
        """
        if positions == 0:
            return
        if not 0 < positions <= MAX_REWIND:
            raise ValueError(f"a rewind goes back 1..{MAX_REWIND} positions, not {positions}")
        if self.conv or self.recurrent:
            raise ValueError("linear-attention layers keep no per-position history: this cache cannot be rewound")
        short = {i: n for i, n in self.lengths.items() if n < positions}
        if short:
            raise ValueError(f"layers {sorted(short)} hold fewer than the {positions} positions to rewind")
        for layer_idx in self.lengths:
            self.lengths[layer_idx] -= positions

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys' and values' buffers (the room for later tokens included) and
        the linear-attention layers' states: what the session costs in memory (the session cache
        cap counts this, ADR-0031)."""
        held = (*self.keys.values(), *self.values.values(), *self.conv.values(), *self.recurrent.values())
        return sum(t.numel() * t.element_size() for t in held)


def causal_mask(q_len: int, past_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive attention mask ``[1, 1, q_len, past_len + q_len]`` (0 = attend, min = blocked).

    Returns None where SDPA needs no mask: a single query token (it attends to everything
    cached) and a chunk at position 0 (SDPA's own ``is_causal`` path, which builds nothing).
    """
    if q_len == 1 or past_len == 0:
        return None
    q_pos = torch.arange(past_len, past_len + q_len)[:, None]
    k_pos = torch.arange(past_len + q_len)[None, :]
    mask = torch.zeros(q_len, past_len + q_len, dtype=dtype)
    mask.masked_fill_(k_pos > q_pos, torch.finfo(dtype).min)
    return mask[None, None]


class RaggedKV:
    """Keys (or values) of a batch whose rows have different lengths: ``rows[b]`` is row ``b``'s
    own cached tensor ``[1, kv_heads, length_b, head_dim]`` (a view of its session's buffer).
    ``spans`` (a packed batch, :class:`PackedCache`): session ``b``'s queries are positions
    ``offset .. offset + q`` of the packed row, at absolute positions from ``position``, as
    ``(offset, q, position)``; None: one query per row of the batch."""

    __slots__ = ("rows", "spans")

    def __init__(self, rows: list[torch.Tensor], spans: list[tuple[int, int, int]] | None = None) -> None:
        self.rows, self.spans = rows, spans


class BatchCache(BatchLinearStates):
    """The KV caches of a batch of sessions, one per row, seen as one cache by the attention modules.

    ``update`` writes row ``b`` of the new keys and values into ``caches[b]`` (in place, see
    :class:`KVCache`) and returns :class:`RaggedKV` views that :func:`attention` runs row by row.
    """

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches
        self._conv: dict[int, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[RaggedKV, RaggedKV]:
        keys, values = [], []
        for row, cache in enumerate(self.caches):
            k, v = cache.update(key_states[row:row + 1], value_states[row:row + 1], layer_idx)
            keys.append(k)
            values.append(v)
        return RaggedKV(keys), RaggedKV(values)


class PackedCache(BatchCache):
    """The KV caches of a packed batch (ADR-0058): the steps of several sessions, each of one or a
    few positions (a decode step, a speculative step), one after another in a single row ``[1,
    total, ...]``, so every linear layer runs once over all of them. ``update`` writes each
    session's span of the new keys and values into its own cache and returns :class:`RaggedKV`
    views that carry the spans; :func:`attention` runs each span causally over its own cache.

    Args:
        caches: one per session; ``q_lens[b]`` positions of session ``b``, the first at absolute
            position ``positions[b]`` (its cache's length).
    """

    def __init__(self, caches: list[KVCache], q_lens: list[int], positions: list[int]) -> None:
        super().__init__(caches)
        offsets = [sum(q_lens[:b]) for b in range(len(q_lens))]
        self.spans = list(zip(offsets, q_lens, positions))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[RaggedKV, RaggedKV]:
        keys, values = [], []
        for (offset, q, _), cache in zip(self.spans, self.caches):
            k, v = cache.update(key_states[..., offset:offset + q, :], value_states[..., offset:offset + q, :],
                                layer_idx)
            keys.append(k)
            values.append(v)
        return RaggedKV(keys, self.spans), RaggedKV(values, self.spans)
