"""What fits where: the data placement plans over, and the memory and coverage arithmetic.

Model specs, node states, assignments and plans (plain frozen data), a node's memory budget in
layers (ADR-0003), coverage counts and gaps over half-open :class:`~meshnet.layers.LayerRange`
(ADR-0002), and the single-node range :func:`find_assignment` gives a joining node (ADR-0011).
:mod:`meshnet.tracker.placement` plans a whole network with them. Sizes are in bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import accumulate, groupby
from operator import not_
from types import MappingProxyType
from typing import NamedTuple

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from meshnet.protocol.control import TIERS  # ADR-0026; only managed shards ever move

MEMORY_FRACTION = 0.8
"""Share of a node's memory budget that shards may fill; the rest is left to activations,
KV caches and the runtime (ADR-0003)."""
_NUM, _DEN = Fraction(MEMORY_FRACTION).limit_denominator(1000).as_integer_ratio()   # exact 4/5


@dataclass(frozen=True)
class ModelSpec:
    """A model as placement sees it: ``num_layers`` decoder layers, ``bytes_per_layer`` per
    quantization (``"bfloat16"``, ``"int8"``, ``"int4"``, ``"nf4"``) and ``demand`` in requests/min."""

    name: str
    num_layers: int
    bytes_per_layer: Mapping[str, int]
    demand: float = 0.0


@dataclass(frozen=True)
class Assignment:
    """One shard of ``model`` on a node; ``tier`` is ``pinned``, ``bootstrap`` or ``managed``."""

    model: str
    layers: LayerRange
    tier: str

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"unknown tier {self.tier!r}; expected one of {TIERS}")


class NodeState(NamedTuple):
    """A node as placement sees it: ``vram_bytes`` of memory, its recipe (``quantization``),
    measured throughput in tokens/s, ``max_loaded_shards`` shard slots (>= 1), the shards it
    holds now, whether the tracker may add shards to it (ADR-0003), and model -> bytes per
    layer it measured holding that model in its recipe (doctor's ``resident_bytes`` over the
    shard's layers, ADR-0039); see :func:`layer_bytes`.

    A named tuple, not a frozen dataclass: a rebalance makes one per node of the network, and a
    tuple is built in a fifth of a frozen dataclass's time (``bench/placement.py``; changes go
    through ``_replace``)."""

    node_id: str
    vram_bytes: int
    quantization: str
    tokens_per_s: float
    max_loaded_shards: int
    assignments: tuple[Assignment, ...] = ()
    accepts_placement: bool = True
    measured_bytes_per_layer: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class PlacementPlan:
    """Result of :func:`plan_placement` (ADR-0003): node_id -> full desired shard set, the
    ``(node_id, Assignment)`` pairs to load and to drop to get there, and node_id -> a short
    human reason why the node did or did not receive a range, and model -> copies of each of its
    layers once the plan is carried out (the coverage map of the desired sets, ADR-0003; empty
    where the planner did not give it)."""

    assignments: Mapping[str, tuple[Assignment, ...]]
    loads: tuple[tuple[str, Assignment], ...]
    drops: tuple[tuple[str, Assignment], ...]
    reasons: Mapping[str, str]
    coverage: Mapping[str, Sequence[int]] = field(default_factory=dict)


def memory_budget_bytes(vram_bytes: int) -> int:
    """Bytes of shard weights a node may hold: ``floor(vram_bytes * MEMORY_FRACTION)`` (ADR-0003)."""
    return max(0, vram_bytes) * _NUM // _DEN


def layer_bytes(node: NodeState, spec: ModelSpec) -> int:
    """Bytes one layer of ``spec`` costs on ``node``: the preset's ``bytes_per_layer`` for the
    node's recipe, or the node's measured figure for this model when that is larger (ADR-0039).

    0 when the preset has no size for the recipe (the model is then never placed there).
    """
    preset = spec.bytes_per_layer.get(node.quantization, 0)
    if preset <= 0:
        return 0
    return max(preset, node.measured_bytes_per_layer.get(spec.name, 0))


def max_assignable_layers(vram_bytes: int, bytes_per_layer: int) -> int:
    """Layers that fit a memory budget: ``floor(vram_bytes * 0.8 / bytes_per_layer)`` (ADR-0003).

    Computed in exact integer arithmetic; e.g. 8 GiB of bfloat16 SmolLM2 layers
    (7,080,192 bytes each) gives 970.

    Raises:
        ValueError: if ``bytes_per_layer`` is not positive.
    """
    if bytes_per_layer <= 0:
        raise ValueError(f"bytes_per_layer must be positive, got {bytes_per_layer}")
    return memory_budget_bytes(vram_bytes) // bytes_per_layer


def coverage_counts(num_layers: int, ranges: Iterable[LayerRange]) -> list[int]:
    """Copies (node count) of each layer ``0..num_layers-1`` among ``ranges``, the coverage
    map of ADR-0003, by a difference array in O(layers + ranges). Parts of a range past the
    model's end are ignored."""
    diff = [0] * (num_layers + 1)
    for layers in ranges:
        diff[layers.start if layers.start < num_layers else num_layers] += 1
        diff[layers.end if layers.end < num_layers else num_layers] -= 1
    return list(accumulate(diff[:num_layers]))


def find_gaps(num_layers: int, counts: Sequence[int]) -> list[LayerRange]:
    """Coverage gaps (ADR-0003): maximal runs of layers whose count is 0, in layer order."""
    gaps, layer = [], 0
    for empty, run in groupby(counts[:num_layers], key=not_):
        width = sum(1 for _ in run)
        if empty:
            gaps.append(LayerRange(layer, layer + width))
        layer += width
    return gaps


def find_assignment(model: ModelSpec, counts: Sequence[int], vram_bytes: int,
                    quantization: str) -> tuple[LayerRange, bool]:
    """Range for a joining node (``GET /v1/network/assign``, ADR-0011): ``(range, gap_found)``.

    With a gap, the first gap clipped to :func:`max_assignable_layers` from its start;
    without one, ``gap_found`` is False and the range is the full model ``[0, num_layers)``.

    Raises:
        InvalidRequest: unknown quantization, or not even one layer fits in the budget.
    """
    if quantization not in model.bytes_per_layer:
        raise InvalidRequest(f"model {model.name!r} has no size for quantization {quantization!r}",
                             hint=f"use one of {', '.join(model.bytes_per_layer)}")
    gaps = find_gaps(model.num_layers, counts)
    if not gaps:
        return LayerRange(0, model.num_layers), False
    fit = max_assignable_layers(vram_bytes, model.bytes_per_layer[quantization])
    if fit < 1:
        raise InvalidRequest(f"{vram_bytes} bytes cannot hold one {quantization} layer of {model.name}",
                             hint="use a smaller quantization or give the node more memory")
    return LayerRange(gaps[0].start, min(gaps[0].end, gaps[0].start + fit)), True
