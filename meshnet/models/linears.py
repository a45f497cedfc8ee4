"""How a shard's linear layers run on this host: weight layout and half-precision products.

Both are measured once per host, dtype and torch thread count (in ``warm_runtime``, before a
shard's memory is measured; :mod:`meshnet.models.hosttimings` keeps them for the host's other
processes), because they depend on the CPU's kernels.

**Weight layout (ADR-0048).** ``nn.Linear`` multiplies by the transpose of its ``[out, in]``
weight. A product of a few rows (a decode step, a batch of them) may run faster with the weight
stored ``[in, out]`` (:func:`transpose`: a transposed view; modules, state dict and values are
unchanged), or in oneDNN's blocked format for a given row count (``packed``:
:class:`PackedLinear`, the reordered weights torch's CPU compiler uses). :func:`layout` picks
one from :func:`measure_layout`, timed on weights larger than the cache (ADR-0048 has the figures).

**Half-precision products in float32 (ADR-0047).** A bfloat16 (or float16) node keeps its
weights in half precision: half the memory and bytes read per decode token. A CPU without
native bfloat16 instructions (AVX2, AVX-512 without ``avx512_bf16``, no AMX) runs a half matrix
product at a cost linear in its rows, so prefill, a replay and large batches pay several times
float32's compute. :class:`UpcastLinear` casts the input and the weight to float32 for products
of at least ``min_rows`` rows and rounds the result back; the weight's cast is paid per call, so
single-token steps keep the half kernel. Both paths accumulate in float32 and round once, so they
differ only in summation order. :func:`min_rows` finds the crossover by timing both paths
(:func:`choose_min_rows` decides), so a CPU with fast half kernels keeps them.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from meshnet.models.hosttimings import KEPT, remembered
from meshnet.models.kernels import ENV, HALF, MIN_GAIN, PackedLinear, UpcastLinear, per_thread_count, upcast_off

log = logging.getLogger(__name__)

#: row counts timed by :func:`measure` (a decode batch's sizes up to a prefill chunk's)
ROWS = (4, 8, 16, 32, 64)
#: the timed product: the MLP up-projection of a 576-wide model, ``[rows, 576] × [576, 1536]``
#: (the crossover depends on the kernels; cast and product both scale with the weight's size)
SHAPE = (1536, 576)
#: weight layouts: ``row`` is ``nn.Linear``'s own ``[out, in]``, ``transposed`` stores ``[in, out]``,
#: ``packed`` oneDNN's blocked format (:class:`PackedLinear`; measured only where torch has oneDNN)
LAYOUTS = ("row", "transposed", "packed")
#: row counts the layout is timed at: a lone decode step and a batch of 8 sessions
LAYOUT_ROWS = (1, 8)
#: another layout than ``row`` is chosen when ``row``'s worst slowdown is at least this many times
#: its own (a margin for noise: within it, ``nn.Linear``'s own layout; see :func:`choose_layout`)
LAYOUT_GAIN = 1.05
#: the row count oneDNN blocks a packed weight for (its ``batch_size`` hint): a batch of 8
#: sessions. Blocked for 8 rows, a weight serves 1 row about as fast as blocked for 1, and 8 or more
#: rows far faster (ADR-0048).
PACK_ROWS = 8
#: weights of fewer elements than this keep ``row`` unmeasured: a shard of them sits in cache,
#: where the layout barely matters (the tiny test models), and timing them would cost more
LAYOUT_MIN_ELEMENTS = 65_536
#: the most distinct weights one timing pass cycles through
LAYOUT_MAX_WEIGHTS = 512
#: environment override of the layout: ``row``, ``transposed`` or ``packed``
LAYOUT_ENV = "MESHNET_WEIGHT_LAYOUT"


@functools.cache
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU can run :class:`PackedLinear` in ``dtype``: torch has
    oneDNN, and a small weight of that dtype packs and multiplies (tried once per process and
    dtype). oneDNN packs bfloat16 only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on an
    AVX2-only CPU the reorder raises, and bfloat16 weights keep ``row`` or ``transposed``."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 16, dtype=dtype), PACK_ROWS)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=dtype), weight, None, "none", [], "")
    except RuntimeError as exc:
        log.info("%s weights cannot be packed on this CPU: %s", str(dtype).removeprefix("torch."), exc)
        return False
    return True


#: why a dtype is not packed here (:func:`packing_available` false), for every refusal
_NO_PACKING = "with this torch build on this CPU (oneDNN missing, or no bfloat16 support in it)"


def available_layouts(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The :data:`LAYOUTS` this torch build and CPU can store ``dtype`` weights in (``packed`` only
    where :func:`packing_available` for ``dtype``)."""
    return tuple(name for name in LAYOUTS if name != "packed" or packing_available(dtype))


def pack(linear: nn.Linear) -> None:
    """Make ``linear`` a :class:`PackedLinear`, in place: its weight is reordered once into oneDNN's
    blocked format (one weight's bytes of peak above the layer). A no-op if it is packed already.

    Raises:
        RuntimeError: this torch build or CPU cannot pack the weight's dtype (:func:`packing_available`).
    """
    if isinstance(linear, PackedLinear):
        return
    if not packing_available(linear.weight.dtype):
        raise RuntimeError(f"{str(linear.weight.dtype).removeprefix('torch.')} weights cannot be packed {_NO_PACKING}")
    weight = linear.weight.detach().contiguous()
    del linear._parameters["weight"]
    linear.__class__ = PackedLinear
    linear.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS))


def dense_weight(linear: nn.Linear) -> torch.Tensor:
    """``linear``'s weight ``[out, in]`` as a plain tensor, whatever its layout (a copy for a
    :class:`PackedLinear`, the parameter itself otherwise)."""
    return linear.weight.to_dense() if isinstance(linear, PackedLinear) else linear.weight


def set_weight(linear: nn.Linear, weight: torch.Tensor) -> None:
    """Replace ``linear``'s weight values with ``weight`` ``[out, in]``, keeping its layout
    (a packed weight is packed again)."""
    with torch.no_grad():
        if isinstance(linear, PackedLinear):
            linear.weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(linear.weight.dtype).contiguous(),
                                                                    PACK_ROWS)
        else:
            linear.weight.copy_(weight)


def upcast_linears(module: nn.Module, rows: int | None) -> int:
    """Make every half-precision ``nn.Linear`` under ``module`` an :class:`UpcastLinear` (a
    :class:`PackedLinear` stays packed) with ``min_rows = rows``, in place (parameters
    untouched); returns how many. ``rows=None`` changes nothing and returns 0."""
    if rows is None:
        return 0
    count = 0
    for child in module.modules():
        if type(child) in (nn.Linear, UpcastLinear, PackedLinear) and child.weight.dtype in HALF:
            if not isinstance(child, PackedLinear):
                child.__class__ = UpcastLinear
            child.min_rows = rows
            count += 1
    return count


def stream_bytes() -> int:
    """Bytes a layout timing pass reads: twice the largest CPU cache (Linux sysfs), so that every
    product reads its weight from memory as a decode step through a shard does; 96 MiB where the
    cache size cannot be read. Bounded to 32-256 MiB."""
    largest = 0
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return min(max(2 * largest, 32 << 20), 256 << 20) if largest else 96 << 20


def transpose(linear: nn.Linear) -> None:
    """Store ``linear``'s weight as ``[in, out]`` contiguous, exposed to the module as its
    transposed view ``[out, in]`` (same shape, dtype and values; the product becomes
    ``x @ W_stored``). Copies the weight once; a no-op if it is stored so already."""
    weight = linear.weight.detach()
    linear.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)


def store(linear: nn.Linear, name: str) -> None:
    """Store ``linear``'s weight in layout ``name`` (a :data:`LAYOUTS` name), in place: ``row``
    leaves it as it is, ``transposed`` is :func:`transpose`, ``packed`` is :func:`pack`."""
    if name == "transposed":
        transpose(linear)
    elif name == "packed":
        pack(linear)


def apply_layouts(module: nn.Module) -> dict[str, int]:
    """Give every ``nn.Linear`` under ``module`` the layout :func:`layout` measured for its dtype
    and shape; returns how many were stored in each layout other than ``row``. One weight is
    copied at a time, so the peak is one weight's bytes above the shard."""
    count: dict[str, int] = {}
    for child in list(module.modules()):
        if isinstance(child, nn.Linear) and not isinstance(child, PackedLinear):
            chosen = layout(child.weight.dtype, tuple(child.weight.shape))
            if chosen != "row":
                store(child, chosen)
                count[chosen] = count.get(chosen, 0) + 1
    return count


def choose_layout(samples: dict[str, dict[int, float]], gain: float = LAYOUT_GAIN) -> str:
    """The layout whose worst slowdown against the fastest layout, over the timed row counts, is
    the smallest; ``row`` unless its own worst slowdown is at least ``gain`` × the chosen one's.

    A node runs both regimes: a lone session's step (1 row), where latency counts, and a batch
    of 8 sessions, where throughput does. The rule avoids a layout that is much slower in one
    to save a little in the other (the mean cost per row, this rule's predecessor, could pick a
    layout twice as slow for a lone session; ADR-0048).

    Args:
        samples: layout → row count → seconds per product (:func:`measure_layout`); layouts
            not timed at every count of ``row`` are not candidates.
    """
    row = samples.get("row", {})
    candidates = {name: by_rows for name, by_rows in samples.items() if row and set(row) <= set(by_rows)}
    if not candidates:
        return "row"
    fastest = {n: min(by_rows[n] for by_rows in candidates.values()) for n in row}
    worst = {name: max(by_rows[n] / fastest[n] for n in row) for name, by_rows in candidates.items()}
    best = min((name for name in candidates if name != "row"), key=worst.__getitem__, default="row")
    return best if worst["row"] >= gain * worst[best] else "row"


def measure_layout(dtype: torch.dtype, shape: tuple[int, int], rows: tuple[int, ...] = LAYOUT_ROWS,
                   repeats: int = 5, total_bytes: int | None = None) -> dict[str, dict[int, float]]:
    """Seconds per ``[rows, in] × [in, out]`` product in ``dtype``, for a weight of ``shape``
    ``(out, in)`` stored each way (``packed`` only where :func:`packing_available` for ``dtype``): layout →
    row count → median over ``repeats`` interleaved
    passes, each over distinct weights of ``total_bytes`` in all (default :func:`stream_bytes`,
    read from memory, not cache; at most :data:`LAYOUT_MAX_WEIGHTS`). A weight larger than that
    (an LM head) is timed on its first rows that fit: the same kernels at a fraction of the
    time. About 0.5-1.2 s per shape; three times ``total_bytes`` is allocated while it runs."""
    total_bytes = total_bytes or stream_bytes()
    gen = torch.Generator().manual_seed(0)
    row_bytes = shape[1] * torch.empty((), dtype=dtype).element_size()
    shape = (max(1, min(shape[0], total_bytes // row_bytes)), shape[1])
    count = min(LAYOUT_MAX_WEIGHTS, max(1, -(-total_bytes // (shape[0] * row_bytes))))
    weights = [torch.randn(shape, generator=gen).to(dtype) for _ in range(count)]
    stored = {name: [_probe(w, name) for w in weights] for name in available_layouts(dtype)}
    del weights
    inputs = {n: torch.randn(n, shape[1], generator=gen).to(dtype) for n in rows}
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in stored}
    with torch.inference_mode():
        for i in range(repeats + 1):
            for name, probes in stored.items():
                for n, x in inputs.items():
                    start = time.perf_counter()
                    for probe in probes:
                        probe(x)
                    if i:  # the first pass warms every path
                        times[name][n].append((time.perf_counter() - start) / len(probes))
    return {name: {n: statistics.median(ts) for n, ts in by_rows.items()} for name, by_rows in times.items()}


def _probe(weight: torch.Tensor, name: str) -> nn.Linear:
    """A bias-free linear holding ``weight`` ``[out, in]`` stored in layout ``name`` (no copy for ``row``)."""
    probe = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    probe.weight = nn.Parameter(weight, requires_grad=False)
    store(probe, name)
    return probe


@per_thread_count
def layout(dtype: torch.dtype, shape: tuple[int, int]) -> str:
    """The layout this process stores ``dtype`` weights of ``shape`` ``(out, in)`` in:
    :func:`choose_layout` over :func:`measure_layout`, once per host, dtype, shape and thread
    count (:func:`per_thread_count` in the process, :func:`~meshnet.models.hosttimings.remembered`
    across the host's processes; a shard has four or five shapes: its projections and, at the
    entry, the LM head). Weights of
    under :data:`LAYOUT_MIN_ELEMENTS` keep ``row`` unmeasured. :data:`LAYOUT_ENV` overrides it.

    Raises:
        ValueError: :data:`LAYOUT_ENV` is set to something other than a :data:`LAYOUTS` name, or to
            ``packed`` where :func:`packing_available` is false for ``dtype``.
    """
    forced = os.environ.get(LAYOUT_ENV, "").strip().lower()
    if forced:
        if forced not in LAYOUTS:
            raise ValueError(f"{LAYOUT_ENV} must be one of {', '.join(LAYOUTS)}, got {forced!r}")
        if forced == "packed" and not packing_available(dtype):
            name = str(dtype).removeprefix("torch.")
            raise ValueError(f"{LAYOUT_ENV}=packed cannot store {name} weights {_NO_PACKING}")
        return forced
    if shape[0] * shape[1] < LAYOUT_MIN_ELEMENTS:
        return "row"
    name = str(dtype).removeprefix("torch.")

    def timed() -> str:
        samples = measure_layout(dtype, shape)
        chosen = choose_layout(samples)
        log.info("%s weights %s stored %s (ms per product by rows, %s: %s)", name, "x".join(map(str, shape)), chosen,
                 " / ".join(samples), ", ".join(f"{n}: " + "/".join(f"{by_rows[n] * 1e3:.3f}" for by_rows in
                                                                 samples.values()) for n in samples["row"]))
        return chosen

    offered = available_layouts(dtype)
    key = f"layout|{name}|{shape[0]}x{shape[1]}|threads {torch.get_num_threads()}|of {','.join(offered)}"
    chosen, measured = remembered(key, timed, valid=offered.__contains__)
    if not measured:
        log.info("%s weights %s stored %s (this host's timing, %s)", name, "x".join(map(str, shape)), chosen, KEPT)
    return chosen


def choose_min_rows(samples: dict[int, tuple[float, float]], gain: float = MIN_GAIN) -> int | None:
    """The smallest row count from which the float32 path wins, or None where it never does.

    Args:
        samples: row count → (half kernel seconds, float32 path seconds).
        gain: how many times as fast the float32 path must be (:data:`MIN_GAIN`).

    Returns:
        The smallest ``r`` in ``samples`` such that for every timed count ``>= r`` the half
        kernel takes at least ``gain`` × the float32 path; None when the largest count fails.
    """
    chosen = None
    for rows in sorted(samples, reverse=True):
        half_s, upcast_s = samples[rows]
        if half_s < gain * upcast_s:
            break
        chosen = rows
    return chosen


def measure(dtype: torch.dtype, rows: tuple[int, ...] = ROWS, repeats: int = 7,
            calls: int = 3) -> dict[int, tuple[float, float]]:
    """Time the half kernel and the float32 path on a :data:`SHAPE` product, on this thread's
    torch threads: row count → (half seconds, float32 path seconds) per call, medians of
    ``repeats`` interleaved samples of ``calls`` calls. About 0.5 s on a slow CPU."""
    gen = torch.Generator().manual_seed(0)
    probe = _probe(torch.randn(SHAPE, generator=gen).to(dtype), layout(dtype, SHAPE))  # as the shard's weights
    upcast_linears(probe, 1)
    out = {}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, SHAPE[1], generator=gen).to(dtype)
            times: tuple[list[float], list[float]] = ([], [])
            for i in range(repeats + 1):
                for path, min_rows in ((0, count + 1), (1, count)):
                    probe.min_rows = min_rows
                    start = time.perf_counter()
                    for _ in range(calls):
                        probe(x)
                    if i:  # the first round warms both paths
                        times[path].append((time.perf_counter() - start) / calls)
            out[count] = (statistics.median(times[0]), statistics.median(times[1]))
    return out


@per_thread_count
def min_rows(dtype: torch.dtype) -> int | None:
    """Rows from which this host runs ``dtype`` products in float32 (:func:`choose_min_rows` over
    :func:`measure`), None for float32 itself or where the half kernels hold up. Measured once
    per host, dtype and thread count (as :func:`layout`); :data:`ENV` overrides it (``off`` or a row count).

    Raises:
        ValueError: :data:`ENV` is neither ``off`` nor a positive integer.
    """
    forced = os.environ.get(ENV, "").strip().lower()
    if dtype not in HALF or upcast_off():
        return None
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{ENV} must be 'off' or a positive row count, got {forced!r}")
        return int(forced)
    name = str(dtype).removeprefix("torch.")

    def timed() -> int | None:
        samples = measure(dtype)
        chosen = choose_min_rows(samples)
        log.info("%s products %s (half ms / float32 path ms by rows: %s)", name, _from_rows(chosen),
                 ", ".join(f"{r}: {h * 1e3:.2f}/{u * 1e3:.2f}" for r, (h, u) in samples.items()))
        return chosen

    chosen, measured = remembered(f"min_rows|{name}|threads {torch.get_num_threads()}", timed,
                                  valid=lambda rows: rows is None or (type(rows) is int and rows > 0))
    if not measured:
        log.info("%s products %s (this host's timing, %s)", name, _from_rows(chosen), KEPT)
    return chosen


def _from_rows(rows: int | None) -> str:
    """How a :func:`min_rows` answer reads in a log line."""
    return "stay in half precision at every row count" if rows is None else f"from {rows} rows run in float32"


#: cached lengths a decode step's attention is timed at: a short chat, and a long one
ATTENTION_LENGTHS = (128, 1024)
#: query heads, key-value heads and head size of the timed attention (SmolLM2-135M's grouping of
#: 3 query heads per key-value head, at the head size most Llama-style models use)
ATTENTION_SHAPE = (9, 3, 64)


@per_thread_count
def attention_in_float32(dtype: torch.dtype) -> bool:
    """Whether this process runs a half-precision decode step's attention in float32: the query,
    keys and values cast up, torch's SDPA in float32, the output rounded once back to ``dtype``.

    Measured once per host, dtype and thread count (:func:`measure_attention`, kept as
    :func:`meshnet.models.linears.layout` keeps its timings): chosen when the float32 path is at
    least :data:`MIN_GAIN` times as fast as the half kernel at every length
    timed. A CPU without native bfloat16 runs the cast float32 path several times faster
    (ADR-0047's attention amendment gives the figures); where the CPU computes bfloat16 natively
    the half kernel may win, and is kept. False for float32, and where ``MESHNET_UPCAST_MIN_ROWS=off``
    keeps every product in half precision (ADR-0047).
    """
    if dtype not in HALF or upcast_off():
        return False
    name = str(dtype).removeprefix("torch.")

    def timed() -> bool:
        samples = measure_attention(dtype)
        chosen = all(half >= MIN_GAIN * upcast for half, upcast in samples.values())
        log.info("%s decode attention runs in %s (half / float32 path µs by cached length: %s)", name,
                 "float32" if chosen else "half precision",
                 ", ".join(f"{n}: {h * 1e6:.0f}/{u * 1e6:.0f}" for n, (h, u) in samples.items()))
        return chosen

    chosen, measured = remembered(f"attention in float32|{name}|threads {torch.get_num_threads()}", timed,
                                  valid=lambda value: isinstance(value, bool))
    if not measured:
        log.info("%s decode attention runs in %s (this host's timing, %s)", name,
                 "float32" if chosen else "half precision", KEPT)
    return chosen


def measure_attention(dtype: torch.dtype, lengths: tuple[int, ...] = ATTENTION_LENGTHS, calls: int = 50,
                      repeats: int = 5) -> dict[int, tuple[float, float]]:
    """Seconds per decode-step attention call in ``dtype``, at each cached length: ``(half kernel,
    float32 path)``, medians of ``repeats`` interleaved passes of ``calls`` calls. Keys and values
    are views of a longer buffer, as a KV cache holds them (:data:`ATTENTION_SHAPE` heads)."""
    heads, kv_heads, head_dim = ATTENTION_SHAPE
    gen = torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for length in lengths:
            query = torch.randn(1, heads, 1, head_dim, generator=gen).to(dtype)
            key, value = (torch.randn(1, kv_heads, length + 64, head_dim, generator=gen).to(dtype)[..., :length, :]
                          for _ in range(2))
            paths = (lambda: sdpa(query, key, value, enable_gqa=True),
                     lambda: sdpa(query.float(), key.float(), value.float(), enable_gqa=True).to(dtype))
            times: list[list[float]] = [[], []]
            for i in range(repeats + 1):
                for path, into in zip(paths, times):
                    start = time.perf_counter()
                    for _ in range(calls):
                        path()
                    if i:  # the first pass warms both
                        into.append((time.perf_counter() - start) / calls)
            out[length] = (statistics.median(times[0]), statistics.median(times[1]))
    return out
