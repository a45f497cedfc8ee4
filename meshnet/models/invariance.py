"""Batch invariance: a row's result does not depend on the rows beside it (ADR-0064).

A decode step of several sessions runs their rows through each linear layer as one product. A
CPU kernel may sum a row's products in another order when the product holds one row than when it
holds several (a matrix-vector path for one row, blocked ones for more), so greedy answers at
temperature 0 could change with the load. Here the rule each layer needs is measured once per host,
dtype, weight shape, layout and thread count (as its layout is, :mod:`meshnet.models.linears`):
random rows are multiplied in products of every count in :data:`ROW_COUNTS`, and each row's result
compared bit for bit with the same row's in a product of two rows.

- every count agrees: :data:`~meshnet.models.kernels.ANY_ROWS`, nothing changes;
- every count of two or more agrees, one row alone does not: :data:`~meshnet.models.kernels.PAD_ROWS`,
  a lone row runs beside a copy of itself (a product of two rows costs about what one costs
  when the weights' bytes bound it);
- otherwise :data:`~meshnet.models.kernels.SPLIT_ROWS`: each row alone, as many weight passes as
  rows. Applied only when asked (:data:`ENV` ``on``): at a batch of 8 it costs several times the
  batched product.

The attention of a step of several positions (a speculative step) runs position by position
(:func:`meshnet.models.kernels.positionwise_attention`); under ``on`` a product of a decode step's
size never switches to the float32 path (:data:`UPCAST_FROM`), which ``auto`` keeps where a host
has one (a CPU without native bfloat16, ADR-0047: there batched rows are not invariant by
default). :data:`ENV`: ``auto`` (default: the half-precision dtypes, and int8/int4 shards in any
dtype (:data:`ROW_WISE_RECIPES`), without ``split``), ``on`` (every dtype, ``split`` too) or ``off``.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from meshnet.models.hosttimings import KEPT, remembered
from meshnet.models.kernels import ANY_ROWS, HALF, INVARIANT_SPAN, NO_UPCAST, PAD_ROWS, SPLIT_ROWS, PackedLinear, \
    UpcastLinear

log = logging.getLogger(__name__)

#: environment switch: ``auto`` (default), ``on`` or ``off``
ENV = "MESHNET_BATCH_INVARIANT"
#: row counts a rule is checked at: batches of sessions, speculative steps of them
ROW_COUNTS = (3, 4, 5, 8, 9, 16, 17, 32, 64, 144)
#: rows of each trial also run alone (a lone row's sums differ from a pair's only for some values)
SINGLES = 32
#: random inputs tried per rule (each a product of every count in :data:`ROW_COUNTS`)
TRIALS = 4
#: in batch-invariant mode, products of fewer rows than this stay on the half-precision kernel (the
#: largest decode step: 16 sessions of :data:`~meshnet.models.kernels.INVARIANT_SPAN` positions)
UPCAST_FROM = 16 * INVARIANT_SPAN + 1
#: the linear layers a rule is set on (int8 and int4 layers compute each row alone, ADR-0061/0062)
LINEARS = (nn.Linear, UpcastLinear, PackedLinear)


def mode() -> str:
    """:data:`ENV`'s value: ``auto``, ``on`` or ``off``.

    Raises:
        ValueError: another value.
    """
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{ENV} must be auto, on or off, got {value!r}")
    return value


#: recipes whose weight kernels compute each row alone (torch's weight-only int8 and int4 products,
#: ADR-0061/0062): their shards' answers depend on the batch only through what is not quantized
ROW_WISE_RECIPES = ("int8", "int4")


def applies(dtype: torch.dtype, quantization: str = "bfloat16") -> bool:
    """Whether a CPU shard computing in ``dtype`` with weight recipe ``quantization`` runs
    batch-invariant: under :data:`ENV` ``auto`` the half-precision dtypes (their rules cost nothing
    on the hosts measured, ADR-0064; float32's kernels needed ``split`` there) and the recipes of
    :data:`ROW_WISE_RECIPES` in any dtype (what is left to make invariant, the attention of
    speculative spans, costs little); under ``on`` every shard."""
    chosen = mode()
    return chosen == "on" or (chosen == "auto" and (dtype in HALF or quantization in ROW_WISE_RECIPES))


def layout_of(linear: nn.Module) -> str:
    """The weight layout ``linear`` holds (:data:`meshnet.models.linears.LAYOUTS`)."""
    if isinstance(linear, PackedLinear):
        return "packed"
    return "transposed" if linear.weight.stride() == (1, linear.weight.shape[0]) else "row"


def measure_rule(linear: nn.Module, trials: int = TRIALS) -> str:
    """The rule ``linear``'s kernel needs (see the module), from random rows in its own dtype
    through its own forward (its layout and kernel); its weights are read, never changed."""
    gen = torch.Generator().manual_seed(0)
    largest = max(ROW_COUNTS)
    pad_ok = any_ok = True
    with torch.inference_mode():
        for _ in range(trials):
            rows = torch.randn(largest, linear.in_features, generator=gen).to(linear.weight.dtype)
            pairs = torch.cat([linear(rows[k:k + 2]) for k in range(0, largest, 2)])
            singles = torch.cat([linear(rows[k:k + 1]) for k in range(SINGLES)])
            any_ok &= torch.equal(singles, pairs[:SINGLES])
            pad_ok &= all(torch.equal(linear(rows[:count]), pairs[:count]) for count in ROW_COUNTS)
    return ANY_ROWS if any_ok and pad_ok else PAD_ROWS if pad_ok else SPLIT_ROWS


#: the rules this process uses, by host-timing key
_RULES: dict[str, str] = {}


def rule_for(linear: nn.Module, half_only: bool = False) -> str:
    """:func:`measure_rule` of ``linear``, once per host, dtype, shape, layout and thread count
    (kept for the host's other processes, as the layouts are); ``half_only``: of its half-precision
    kernel alone, its float32 path (ADR-0047) left out."""
    dtype = str(linear.weight.dtype).removeprefix("torch.")
    key = (f"rows|{dtype}|{linear.out_features}x{linear.in_features}|{layout_of(linear)}"
           f"|threads {torch.get_num_threads()}{'|half kernel' if half_only else ''}")

    def measure() -> str:
        if not half_only:
            return measure_rule(linear)
        min_rows, linear.min_rows = linear.min_rows, NO_UPCAST  # for the measurement only
        try:
            return measure_rule(linear)
        finally:
            linear.min_rows = min_rows

    if key not in _RULES:
        rule, measured = remembered(key, measure, valid=lambda r: r in (ANY_ROWS, PAD_ROWS, SPLIT_ROWS))
        log.info("%s: %s (%s)", key, rule, "checked just now" if measured else f"this host's check, {KEPT}")
        _RULES[key] = rule
    return _RULES[key]


def make_batch_invariant(module: nn.Module) -> dict[str, int]:
    """Give every floating-point linear layer under ``module`` its rule, in place (a plain
    ``nn.Linear`` that needs one becomes an :class:`UpcastLinear` that never upcasts: the same
    product; one whose rows agree stays as it is, with no call in between), and
    under :data:`ENV` ``on`` keep a decode step's products on one kernel (:data:`UPCAST_FROM`; ``auto``
    keeps the float32 path of a host whose half kernels are slow, ADR-0047, for one session's rows:
    a batch of several runs each as it runs alone, :func:`meshnet.models.kernels.apart_product`).
    Returns rule -> layers.
    Layers of a dtype :func:`applies` refuses are left as they are; under ``auto`` a ``split``
    layer stays batched."""
    chosen = mode()
    counts: dict[str, int] = {}
    for child in module.modules():
        if type(child) not in LINEARS or not child.weight.dtype.is_floating_point or not applies(child.weight.dtype):
            continue
        # a half-precision product with a float32 path (ADR-0047) under auto: several sessions' rows
        # run as each runs alone (kernels.apart_product), so the rule is the half kernel's
        apart = chosen == "auto" and child.weight.dtype in HALF and getattr(child, "min_rows", NO_UPCAST) < NO_UPCAST
        rule = rule_for(child, half_only=apart)
        if apart:  # and a speculative span, at most INVARIANT_SPAN rows, runs as its positions do one by one
            child.apart, child.min_rows = True, max(child.min_rows, INVARIANT_SPAN + 1)
        if rule == SPLIT_ROWS and chosen == "auto":
            rule = ANY_ROWS
        if type(child) is nn.Linear and (rule != ANY_ROWS or apart):
            child.__class__ = UpcastLinear
        if rule != ANY_ROWS or type(child) is not nn.Linear:
            child.rows_rule = rule
        if chosen == "on" and child.weight.dtype in HALF:  # auto keeps a host's float32 path (its speed)
            child.min_rows = max(child.min_rows, UPCAST_FROM)
        counts[rule] = counts.get(rule, 0) + 1
    return counts
