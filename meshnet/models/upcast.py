"""Half-precision matrix products in float32 where the host has no fast half kernels (ADR-0047).

A bfloat16 (or float16) node keeps its weights in half precision: half the memory and half
the bytes read per decode token, which is what makes a one-token step fast. But a CPU without
native bfloat16 instructions (AVX2, AVX-512 without ``avx512_bf16``, no AMX) runs a half
matrix product at a cost linear in its rows: measured on a 2-core AVX-512F host, a
``[rows, 576] × [576, 1536]`` product took 0.22 ms at 1 row and 25 ms at 256 rows in
bfloat16, 5.3 ms at 256 rows in float32. Prefill, a failover's replay and large decode
batches paid four times float32's compute.

:class:`UpcastLinear` casts the input and the weight to float32 for products of at least
``min_rows`` rows and rounds the result back to the compute dtype. The cast of the weight is
paid per call (about 0.3 ms for 0.9 M weights), which is why single-token steps keep the half
kernel. Both paths accumulate in float32 and round the output once, so they differ only in
summation order. :func:`min_rows` finds the crossover on the host by timing both paths
(:func:`choose_min_rows` is the decision), so a CPU with fast half kernels keeps them.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

#: row counts timed by :func:`measure` (a decode batch's sizes up to a prefill chunk's)
ROWS = (4, 8, 16, 32, 64)
#: the float32 path is taken from the first timed row count where it is at least this many
#: times as fast as the half kernel, and stays so for every larger count (a margin for noise)
MIN_GAIN = 1.2
#: the timed product: the MLP up-projection of a 576-wide model, ``[rows, 576] × [576, 1536]``
#: (the crossover depends on the kernels; cast and product both scale with the weight's size)
SHAPE = (1536, 576)
#: environment override: ``off`` keeps the half kernels everywhere, an integer fixes ``min_rows``
ENV = "MESHNET_UPCAST_MIN_ROWS"
HALF = (torch.bfloat16, torch.float16)


class UpcastLinear(nn.Linear):
    """``nn.Linear`` whose product runs in float32 for inputs of at least ``min_rows`` rows.

    Input ``[..., in_features]`` and output ``[..., out_features]`` are in the weight's dtype,
    as for ``nn.Linear``; rows are the input's elements over ``in_features`` (batch × tokens).
    Below ``min_rows`` it is exactly ``nn.Linear``.
    """

    min_rows: int = 1 << 62

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def upcast_linears(module: nn.Module, rows: int | None) -> int:
    """Make every half-precision ``nn.Linear`` under ``module`` an :class:`UpcastLinear` with
    ``min_rows = rows``, in place (parameters untouched); returns how many. ``rows=None``
    changes nothing and returns 0."""
    if rows is None:
        return 0
    count = 0
    for child in module.modules():
        if type(child) in (nn.Linear, UpcastLinear) and child.weight.dtype in HALF:
            child.__class__ = UpcastLinear
            child.min_rows = rows
            count += 1
    return count


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
    weight = torch.randn(SHAPE, generator=gen).to(dtype)
    probe = UpcastLinear(SHAPE[1], SHAPE[0], bias=False, device="meta")
    probe.weight = nn.Parameter(weight, requires_grad=False)
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


@functools.cache
def min_rows(dtype: torch.dtype) -> int | None:
    """Rows from which this host runs ``dtype`` products in float32 (:func:`choose_min_rows` over
    :func:`measure`), None for float32 itself or where the half kernels hold up. Measured once
    per process and dtype; :data:`ENV` overrides it (``off`` or a row count).

    Raises:
        ValueError: :data:`ENV` is neither ``off`` nor a positive integer.
    """
    forced = os.environ.get(ENV, "").strip().lower()
    if dtype not in HALF or forced == "off":
        return None
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{ENV} must be 'off' or a positive row count, got {forced!r}")
        return int(forced)
    samples = measure(dtype)
    chosen = choose_min_rows(samples)
    log.info("%s products from %s rows run in float32 (half ms / float32 path ms by rows: %s)",
             str(dtype).removeprefix("torch."), chosen,
             ", ".join(f"{r}: {h * 1e3:.2f}/{u * 1e3:.2f}" for r, (h, u) in samples.items()))
    return chosen
