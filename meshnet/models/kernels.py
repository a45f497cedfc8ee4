"""What a shard runs on every step: attention with its KV cache, and its linear layers' products.

- the caches it attends over (one session's :class:`~meshnet.models.caches.KVCache`, a batch's
  or a packed batch's) are :mod:`meshnet.models.caches`.
- :func:`attention` is the function transformers' attention modules call (registered as
  :data:`ATTENTION`): SDPA, row by row for a ragged batch, straight to the kernel for a decode
  step (:func:`decode_attention`), and within the window for a sliding-window layer
  (ADR-0050).
- whether this host runs a half-precision decode step's attention in float32 is measured by
  :func:`meshnet.models.linears.attention_in_float32` (ADR-0047) and read from :data:`IN_FLOAT32`.
- :class:`UpcastLinear` and :class:`PackedLinear`: ``nn.Linear`` with a half-precision product
  run in float32 from a row count on (ADR-0047), and with its weight in oneDNN's blocked format
  (ADR-0048). Which layer gets which, and from how many rows, is chosen by timing on this host
  (:mod:`meshnet.models.linears`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from meshnet.models.caches import RaggedKV, causal_mask


#: the float32 path is taken from the first timed row count where it is at least this many
#: times as fast as the half kernel, and stays so for every larger count (a margin for noise)
MIN_GAIN = 1.2
#: environment override: ``off`` keeps the half kernels everywhere, an integer fixes ``min_rows``
ENV = "MESHNET_UPCAST_MIN_ROWS"
HALF = (torch.bfloat16, torch.float16)


def per_thread_count(measured):
    """Cache a host timing's result per argument tuple and torch intra-op thread count.

    A kernel's speed, and so a layout or path chosen from timing it, depends on the threads it
    runs on: a node's calibration builds shards at one candidate count and the node then runs at
    the count it chose. Keyed by the count, a timing made at one count is never reused at another,
    and one made at the node's own count is not made twice. ``cache_clear()`` forgets every count.
    """
    cached = functools.cache(lambda threads, *args: measured(*args))

    @functools.wraps(measured)
    def at_this_count(*args):
        return cached(torch.get_num_threads(), *args)

    at_this_count.cache_clear = cached.cache_clear
    return at_this_count


def upcast_off() -> bool:
    """Whether :data:`ENV` is ``off``: every half-precision product and decode attention stays in
    half precision (ADR-0047)."""
    return os.environ.get(ENV, "").strip().lower() == "off"


#: name of meshnet's attention function in transformers' AttentionInterface
ATTENTION = "meshnet_sdpa"
_sdpa = None  # transformers' SDPA attention function, bound by _register_attention


def attention(module: nn.Module, query: torch.Tensor, key, value, attention_mask: torch.Tensor | None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; a ragged batch (:class:`RaggedKV` keys and values) runs one
    SDPA per row over that row's own cache, with no mask and no padding, so every row computes
    exactly what it computes alone.

    A single query token with no mask (every decode step, batched or not) calls torch's SDPA
    directly (:func:`decode_attention`): the same kernel and the same result as transformers'
    wrapper, without its per-call Python checks. A packed batch (:class:`PackedCache`: ``batch``
    1, the sessions' spans one after another along ``q_len``) runs each span as that step runs
    alone: its own cache, the causal mask of its own position, its window.

    Args:
        query: ``[batch, heads, q_len, head_dim]`` (``q_len == 1`` for a ragged batch).

    Returns:
        ``([batch, q_len, heads, head_dim], None)``.
    """
    scale = kwargs.get("scaling")
    in_float32 = getattr(module.config, IN_FLOAT32, False)
    window = kwargs.pop("sliding_window", None)
    sinks = kwargs.pop("s_aux", None)
    if isinstance(key, RaggedKV) and key.spans is not None:  # a packed batch: each span as it runs alone
        spans = [_attend(module, query[:, :, offset:offset + q], k, v, causal_mask(q, position, query.dtype),
                         window, sinks, in_float32, kwargs)
                 for (offset, q, position), k, v in zip(key.spans, key.rows, value.rows)]
        return torch.cat(spans, dim=1), None
    if isinstance(key, RaggedKV):
        if sinks is not None:
            rows = [sink_attention(query[b:b + 1], *_last(k, v, window), None, scale, sinks)
                    for b, (k, v) in enumerate(zip(key.rows, value.rows))]
            return torch.cat(rows), None
        rows = [decode_attention(query[b:b + 1], *_last(k, v, window), scale, in_float32)
                for b, (k, v) in enumerate(zip(key.rows, value.rows))]
        return torch.cat(rows).transpose(1, 2), None
    return _attend(module, query, key, value, attention_mask, window, sinks, in_float32, kwargs), None


def _attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, window: int | None, sinks: torch.Tensor | None, in_float32: bool,
            kwargs: dict) -> torch.Tensor:
    """One step's attention (:func:`attention` without a ragged batch): ``[batch, q_len, heads, head_dim]``."""
    scale = kwargs.get("scaling")
    if 1 < query.shape[2] <= INVARIANT_SPAN and sinks is None and getattr(module.config, INVARIANT, False):
        return positionwise_attention(query, key, value, window, scale, in_float32)
    if window is not None:
        if query.shape[2] == 1:  # one query: the window is the last ``window`` keys
            key, value = _last(key, value, window)
        else:
            # the window's own causal mask: the shard's mask spans every position, and a
            # sliding layer's cache may hold only its last ``window`` of them
            attention_mask = sliding_mask(None, query.shape[2], key.shape[2], window, query.dtype)
    if sinks is not None:
        return sink_attention(query, key, value, attention_mask, scale, sinks)
    if query.shape[2] == 1 and attention_mask is None and not module.training and kwargs.get("softcap") is None:
        return decode_attention(query, key, value, scale, in_float32).transpose(1, 2)
    return _sdpa(module, query, key, value, attention_mask, **kwargs)[0]


def positionwise_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None,
                           scale: float | None, in_float32: bool) -> torch.Tensor:
    """A span's causal attention with each query run as its own decode step (:func:`decode_attention`
    over the keys up to its position, the last ``window`` of them in a sliding layer), so a
    position's result does not depend on how many positions its step carried (ADR-0064).

    Args:
        query: ``[batch, heads, q_len, head_dim]``, the last ``q_len`` of ``kv_len`` positions.
        key, value: ``[batch, kv_heads, kv_len, head_dim]``.

    Returns:
        ``[batch, q_len, heads, head_dim]`` in the query's dtype.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    rows = [decode_attention(query[:, :, i:i + 1], *_last(key[:, :, :kv_len - q_len + i + 1],
                                                          value[:, :, :kv_len - q_len + i + 1], window),
                             scale, in_float32) for i in range(q_len)]
    return torch.cat(rows, dim=2).transpose(1, 2)


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """Causal attention with one learned sink logit per head (gpt-oss's attention sinks): the sink
    takes part in the softmax's normalisation and contributes no value, so a head may attend to
    nothing. The rule of transformers' gpt-oss eager attention, which SDPA has no argument for.

    Args:
        query: ``[batch, heads, q_len, head_dim]``, the last ``q_len`` of ``kv_len`` positions.
        key, value: ``[batch, kv_heads, kv_len, head_dim]`` (grouped heads are repeated here).
        mask: additive ``[1 or batch, 1, q_len, kv_len]``; None: causal (and nothing for one query).
        scale: the softmax scale (None: ``1 / sqrt(head_dim)``).
        sinks: ``[heads]`` sink logits.

    Returns:
        ``[batch, q_len, heads, head_dim]`` in the query's dtype.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    q_len, kv_len = query.shape[2], key.shape[2]
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if mask is None and q_len > 1:  # causal: a window wider than every key blocks only the future
        mask = sliding_mask(None, q_len, kv_len, kv_len + 1, scores.dtype)
    if mask is not None:
        scores = scores + mask
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, q_len, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2)


def _last(key: torch.Tensor, value: torch.Tensor, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``window`` cached positions of ``key`` and ``value`` ``[.., length, head_dim]``
    (all of them with no window): what a decode step's query attends to in a sliding layer."""
    if window is None or key.shape[-2] <= window:
        return key, value
    return key[..., -window:, :], value[..., -window:, :]


def sliding_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, window: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[1, 1, q_len, kv_len]`` of a sliding-window layer: ``mask`` (the
    shard's causal mask; None: causal) with every key at or before ``q - window`` blocked too,
    for the query at absolute position ``q`` (the queries are the last ``q_len`` of ``kv_len``
    positions). transformers' rule: a query attends to keys in ``(q - window, q]``."""
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    blocked = (k_pos > q_pos) | (k_pos <= q_pos - window)
    out = torch.zeros(q_len, kv_len, dtype=dtype).masked_fill_(blocked, torch.finfo(dtype).min)[None, None]
    return out if mask is None else torch.minimum(out, mask.to(dtype))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float | None, in_float32: bool = False) -> torch.Tensor:
    """One query token attending to every cached position: torch's SDPA with no mask.

    Args:
        query: ``[batch, heads, 1, head_dim]``.
        key, value: ``[batch, kv_heads, length, head_dim]``; ``heads`` a multiple of ``kv_heads``
            (grouped-query attention runs on the key/value heads as stored, no repeat).
        scale: the softmax scale (None: ``1 / sqrt(head_dim)``).
        in_float32: a half-precision query, keys and values are cast to float32 and the output
            rounded once back (:func:`meshnet.models.linears.attention_in_float32` chose it for
            this host; ADR-0047).

    Returns:
        ``[batch, heads, 1, head_dim]`` in the query's dtype.

    transformers' ``sdpa_attention_forward`` makes this same call for a decode step (no mask,
    ``enable_gqa``) after Python checks that cost as much as the kernel itself at a short context,
    so a decode step calls the kernel directly (ADR-0052).
    """
    gqa = query.shape[1] != key.shape[1]
    if in_float32 and query.dtype != torch.float32:  # this host's half kernel is slower than casting (ADR-0047)
        return torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), scale=scale, enable_gqa=gqa).to(query.dtype)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=gqa)


#: the attribute of a shard's model config that says its steps run batch-invariant (ADR-0064):
#: the attention of a span of up to :data:`INVARIANT_SPAN` positions runs position by position
INVARIANT = "meshnet_batch_invariant"
#: the longest span run position by position: a speculative step's last token and its drafts
#: (``meshnet.gateway.speculation.MAX_DRAFTS`` + 1; a test keeps the two equal)
INVARIANT_SPAN = 17
#: the attribute of a shard's model config that says its decode attention runs in float32
#: (:func:`meshnet.models.linears.attention_in_float32`, set at load; the layers' attention modules share the config)
IN_FLOAT32 = "meshnet_attention_in_float32"
def _register_attention() -> None:
    global _sdpa
    if _sdpa is None:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _sdpa = sdpa_attention_forward
        AttentionInterface.register(ATTENTION, attention)


# --- linear layers' kernels (ADR-0047, ADR-0048) ---

#: :attr:`UpcastLinear.rows_rule` values (ADR-0064): ``any``, the kernel gives a row one result
#: whatever the rows beside it; ``pad``, every count of two or more rows agrees and one row alone
#: does not, so a lone row runs beside a copy of itself; ``split``, each row runs alone
ANY_ROWS, PAD_ROWS, SPLIT_ROWS = "any", "pad", "split"
#: a layer's ``min_rows`` where it has no float32 path: no product has that many rows
NO_UPCAST = 1 << 62


#: the rows each session puts in the products of the step in flight, in order (None: one session's
#: step); set by the shard's batched steps (:func:`sessions_apart`) and read by layers whose half-precision
#: product has a float32 path (:attr:`UpcastLinear.apart`)
SESSION_ROWS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("session_rows", default=None)


@contextlib.contextmanager
def sessions_apart(rows: list[int] | tuple[int, ...]):
    """Within the block, the products run are a batch of several sessions, ``rows[b]`` rows of
    session ``b`` after one another (a batched decode step: one each; a packed step: its span)."""
    token = SESSION_ROWS.set(tuple(rows))
    try:
        yield
    finally:
        SESSION_ROWS.reset(token)


def apart_product(x: torch.Tensor, spans: tuple[int, ...], layer: UpcastLinear | PackedLinear) -> torch.Tensor:
    """``layer``'s product of a batch of several sessions' rows (``spans[b]`` rows of session ``b``,
    in order; input ``[..., in]``, output ``[..., out]``) with each row's result what its session
    gets alone (ADR-0064): a session whose rows alone would take the float32 path (at least
    ``min_rows``) runs alone; the others, each of which alone takes the half kernel, run together on
    it under the layer's rule (that kernel's own, measured without the float32 path). A decode step of
    several sessions thus never takes the float32 path, whose sums depend on the row count, while a
    long prefill chunk beside them still does."""
    flat = x.reshape(-1, x.shape[-1])
    out = flat.new_empty(flat.shape[0], layer.out_features)
    small, offset = [], 0
    for rows in spans:
        if rows >= layer.min_rows:
            out[offset:offset + rows] = layer.alone(flat[offset:offset + rows])
        else:
            small.append(torch.arange(offset, offset + rows))
        offset += rows
    if small:
        index = torch.cat(small)
        group = flat[index]
        out[index] = (layer.half_product(group) if layer.rows_rule == ANY_ROWS
                      else batch_invariant(group, layer.half_product, layer.rows_rule))
    return out.reshape(*x.shape[:-1], layer.out_features)


def batch_invariant(x: torch.Tensor, product, rule: str) -> torch.Tensor:
    """``product(x)`` (a linear layer's, input ``[..., in]``, output ``[..., out]``) with its rows
    run by ``rule`` (:data:`PAD_ROWS` or :data:`SPLIT_ROWS`), so each row's result does not depend
    on how many rows the batch holds (ADR-0064)."""
    flat = x.reshape(-1, x.shape[-1])
    if rule == PAD_ROWS:
        if flat.shape[0] != 1:
            return product(x)
        out = product(flat.repeat(2, 1))[:1]
    else:
        out = torch.cat([product(flat[r:r + 1]) for r in range(flat.shape[0])])
    return out.reshape(*x.shape[:-1], out.shape[-1])


class UpcastLinear(nn.Linear):
    """``nn.Linear`` whose product runs in float32 for inputs of at least ``min_rows`` rows.

    Input ``[..., in_features]`` and output ``[..., out_features]`` are in the weight's dtype,
    as for ``nn.Linear``; rows are the input's elements over ``in_features`` (batch × tokens).
    Below ``min_rows`` it is exactly ``nn.Linear``.
    """

    min_rows: int = NO_UPCAST
    #: how a product's rows are run so each row's result is the same in any batch (ADR-0064)
    rows_rule: str = ANY_ROWS
    #: a batch of several sessions' rows runs each as it runs alone (:func:`apart_product`), the
    #: rule then being the half kernel's (ADR-0064); set where the float32 path would break invariance
    apart: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.apart and x.numel() >= self.min_rows * self.in_features:
            spans = SESSION_ROWS.get()
            if spans is not None and len(spans) > 1:
                return apart_product(x, spans, self)
        return self.alone(x)

    def alone(self, x: torch.Tensor) -> torch.Tensor:
        """The product of one session's rows (or of rows whose results may depend on each other)."""
        if self.rows_rule != ANY_ROWS:
            return batch_invariant(x, self._product, self.rows_rule)
        return self._product(x)

    def half_product(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the half-precision kernel, whatever the row count."""
        return F.linear(x, self.weight, self.bias)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * self.in_features:
            return self.half_product(x)
        return _float32_product(x, self.weight, self.bias)


def _float32_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32, rounded once back to ``x``'s dtype (ADR-0047's path)."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


class PackedLinear(nn.Linear):
    """``nn.Linear`` whose weight is held in oneDNN's blocked format for :data:`~meshnet.models.linears.PACK_ROWS` rows.

    The ``weight`` is a buffer: an opaque oneDNN tensor of shape ``[out, in]`` and the layer's
    dtype, the same bytes as a plain weight. It cannot be sliced or written in place:
    :func:`~meshnet.models.linears.dense_weight` reads it, :func:`~meshnet.models.linears.set_weight` replaces it. The state dict holds it
    plain (``[out, in]`` contiguous), so digests and saved shards do not depend on the layout.
    Made by :func:`~meshnet.models.linears.pack`, never constructed directly.

    Input ``[..., in_features]`` and output ``[..., out_features]`` are in the weight's dtype. A
    half-precision layer runs inputs of at least ``min_rows`` rows in float32 on a plain copy of
    its weight (ADR-0047), as :class:`UpcastLinear` does.
    """

    min_rows: int = NO_UPCAST
    rows_rule: str = ANY_ROWS  # as UpcastLinear's
    apart: bool = False  # as UpcastLinear's

    forward, alone = UpcastLinear.forward, UpcastLinear.alone

    def half_product(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the packed half-precision kernel, whatever the row count."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= self.min_rows * self.in_features:
            return _float32_product(x, self.weight.to_dense(), self.bias)
        return self.half_product(x)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight.to_dense()
