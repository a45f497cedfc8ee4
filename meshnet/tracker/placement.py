"""Tracker placement: which node serves which decoder layers (docs/adr/0003, 0011).

Pure functions over plain data: no I/O, no HTTP, no torch. The tracker's rebalance loop
loads node and model state, calls :func:`plan_placement`, and turns the plan's ``loads``
and ``drops`` into ``LOAD_SHARD`` / ``DROP_SHARD`` directives. One call runs, in order:

1. **coverage first** - every model's gaps (layers with no copy) are filled, fastest
   nodes with free memory and a free shard slot first, each to its memory limit;
2. **managed moves** - a ``managed`` shard moves only when that raises the model's
   pipeline bottleneck (tokens/s of its slowest layer) by more than ``min_gain``;
3. **redundancy** - idle nodes add a copy where demand per copy is highest;
4. managed moves again, so the result is a fixed point (re-planning it is a no-op).

Layer ranges are half-open :class:`~meshnet.layers.LayerRange`; sizes are in bytes.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import accumulate
from types import MappingProxyType

from meshnet.layers import LayerRange
from meshnet.tracker.capacity import (MEMORY_FRACTION, Assignment, ModelSpec, NodeState,
                                      PlacementPlan, coverage_counts, find_assignment, find_gaps, layer_bytes,
                                      max_assignable_layers, memory_budget_bytes)

__all__ = ["MEMORY_FRACTION", "Assignment", "ModelSpec", "NodeState", "PlacementPlan", "apply_plan", "coverage_counts",
           "find_assignment", "find_gaps", "layer_bytes", "max_assignable_layers", "memory_budget_bytes",
           "plan_placement"]

_MILLI = 1000   # throughput is summed as integer milli-tokens/s, so sums never depend on order
_NEVER = float("inf")


def _milli(tokens_per_s: float) -> int:
    """Throughput as integer milli-tokens/s: sums are exact, whatever their order."""
    return round(tokens_per_s * _MILLI)


class _Work:
    """Mutable scratch state of one :func:`plan_placement` call; nodes are list positions.

    ``counts`` (copies per layer) and ``profile`` (milli-tokens/s per layer, kept for models
    with movable managed shards) are updated in place as shards are added or moved."""

    def __init__(self, nodes: Sequence[NodeState], models: Sequence[ModelSpec]) -> None:
        self.nodes, self.specs = nodes, {m.name: m for m in models}
        self.order = [i for i, n in enumerate(nodes)   # nodes that may take a shard, fastest first
                      if n.accepts_placement and len(n.assignments) < n.max_loaded_shards]
        self.order.sort(key=[n.node_id for n in nodes].__getitem__)
        self.order.sort(key=[-n.vram_bytes for n in nodes].__getitem__)   # equal speed: bigger first
        self.order.sort(key=[-n.tokens_per_s for n in nodes].__getitem__)   # stable: ties by memory, id
        self.added: dict[int, list[tuple[str, Assignment]]] = {}   # node -> (reason, new shard)
        self.kept: dict[int, list[Assignment]] = {}   # node -> its own shards after managed moves
        self.dirty = set(self.specs)   # models that may have a managed move to make
        self._free: dict[int, int] = {}
        self._entries: dict[tuple, tuple[str, Assignment]] = {}
        self._count_existing()

    def _count_existing(self) -> None:
        """Counts, throughput profiles, movable managed shards and free memory from the shards
        nodes hold."""
        specs = self.specs
        diffs = {name: ([0] * (s.num_layers + 1), [0] * (s.num_layers + 1)) for name, s in specs.items()}
        self.movable: dict[str, list[tuple[int, Assignment]]] = {name: [] for name in specs}
        for i, node in enumerate(self.nodes):
            if not node.assignments:
                continue
            speed, free = _milli(node.tokens_per_s), memory_budget_bytes(node.vram_bytes)
            for a in node.assignments:
                spec = specs.get(a.model)   # a shard of an unknown model keeps its slot only
                if spec is None:
                    continue
                start, end, top = a.layers.start, a.layers.end, spec.num_layers
                free -= (end - start) * layer_bytes(node, spec)
                if end > top:   # a stale range past the model's end counts up to it
                    start, end = min(start, top), top
                counts, profile = diffs[a.model]
                counts[start] += 1
                counts[end] -= 1
                profile[start] += speed
                profile[end] -= speed
                if a.tier == "managed" and node.accepts_placement:
                    self.movable[a.model].append((i, a))
            self._free[i] = free
        self.counts = {name: list(accumulate(c[:-1])) for name, (c, _) in diffs.items()}
        self.profile = {name: list(accumulate(p[:-1]))
                        for name, (_, p) in diffs.items() if self.movable[name]}

    def free_bytes(self, i: int) -> int:
        """Memory budget (ADR-0003) minus the bytes of every shard node ``i`` holds."""
        free = self._free.get(i)
        if free is None:   # not yet counted: an idle node, maybe given shards by this plan
            node = self.nodes[i]
            free = self._free[i] = memory_budget_bytes(node.vram_bytes) - sum(
                len(a.layers) * layer_bytes(node, self.specs[a.model])
                for _, a in self.added.get(i, ()))
        return free

    def free_layers(self, i: int, spec: ModelSpec) -> int:
        """Layers of ``spec`` node ``i`` can still take in a new slot (0 if none)."""
        node = self.nodes[i]
        used = len(node.assignments) + len(self.added.get(i, ()))
        if not node.accepts_placement or used >= node.max_loaded_shards:
            return 0
        per_layer = layer_bytes(node, spec)
        return self.free_bytes(i) // per_layer if per_layer > 0 else 0

    def _entry(self, spec: ModelSpec, start: int, end: int, redundant: bool) -> tuple[str, Assignment]:
        """(reason, bootstrap shard); equal shards share one frozen Assignment and reason."""
        key = (spec.name, start, end, redundant)
        if key not in self._entries:
            a = Assignment(spec.name, LayerRange(start, end), "bootstrap")
            self._entries[key] = (f"coverage complete; added redundancy {a.model} {a.layers}" if redundant
                                  else f"assigned {a.model} {a.layers} to fill a coverage gap", a)
        return self._entries[key]

    def add(self, i: int, spec: ModelSpec, start: int, end: int, *, redundant: bool) -> None:
        """Give node ``i`` a new bootstrap shard ``[start, end)`` and count it."""
        if i in self._free:
            self._free[i] -= (end - start) * layer_bytes(self.nodes[i], spec)
        self.added.setdefault(i, []).append(self._entry(spec, start, end, redundant))
        self.cover(spec.name, start, end, _milli(self.nodes[i].tokens_per_s))

    def add_whole_copies(self, spec: ModelSpec, idle: list[int]) -> None:
        """Give every (idle, so uncached) node in ``idle`` a copy of all of ``spec``; count them."""
        entry = self._entry(spec, 0, spec.num_layers, True)
        for i in idle:
            self.added[i] = [entry]
        speed = sum(_milli(self.nodes[i].tokens_per_s) for i in idle) if spec.name in self.profile else 0
        self.cover(spec.name, 0, spec.num_layers, speed, copies=len(idle))

    def cover(self, model: str, start: int, end: int, speed: int, copies: int = 1) -> None:
        """Add ``copies`` and ``speed`` (milli-tokens/s) to layers ``[start, end)`` of ``model``."""
        counts = self.counts[model]
        counts[start:end] = [c + copies for c in counts[start:end]]
        profile = self.profile.get(model)
        if profile is not None:
            profile[start:end] = [t + speed for t in profile[start:end]]
        self.dirty.add(model)

    def move(self, k: int, new: Assignment) -> None:
        """Replace the ``k``-th movable shard of ``new.model`` by ``new`` (same width)."""
        i, old = self.movable[new.model][k]
        shards = self.kept.setdefault(i, list(self.nodes[i].assignments))
        shards[shards.index(old)] = new
        self.movable[new.model][k] = (i, new)
        speed = _milli(self.nodes[i].tokens_per_s)
        self.cover(old.model, old.layers.start, old.layers.end, -speed, copies=-1)
        self.cover(new.model, new.layers.start, new.layers.end, speed)


def _fill_gaps(work: _Work, spec: ModelSpec) -> None:
    """Cover every gap of ``spec``: fastest nodes first, each taking as many layers as fit;
    a gap wider than one node continues on the next. One pass over the speed order."""
    order, pos = work.order, 0
    for gap in find_gaps(spec.num_layers, work.counts[spec.name]):
        start = gap.start
        while start < gap.end and pos < len(order):
            width = min(work.free_layers(order[pos], spec), gap.end - start)
            if width < 1:
                pos += 1   # capacity only shrinks: a node skipped once never fits later
                continue
            work.add(order[pos], spec, start, start + width, redundant=False)
            start += width


def _pick_model(heap: list, specs: Mapping[str, ModelSpec], node: NodeState,
                free_bytes: int) -> tuple[tuple, ModelSpec, int] | None:
    """Pop the first heap key of a model of which one layer fits ``free_bytes`` on ``node``;
    return it with the model and the layers that fit (at most the whole model). The others go back."""
    skipped, found = [], None
    while heap and found is None:
        key = heapq.heappop(heap)
        spec = specs[key[2]]
        per_layer = layer_bytes(node, spec)
        if 0 < per_layer <= free_bytes:
            found = key, spec, min(free_bytes // per_layer, spec.num_layers)
        else:
            skipped.append(key)
    for key in skipped:
        heapq.heappush(heap, key)
    return found


def _add_redundancy(work: _Work) -> None:
    """Each idle, accepting node adds one copy to the fully covered model with the highest
    demand per copy (demand / fewest copies of any layer; then fewest copies, then name):
    all of it if it fits, else as many layers as fit from the first layer with the fewest
    copies, moved left only as far as the model's end requires (ADR-0003). A model with no
    demand gets no redundant copy: idle nodes stay hot spares for refilling dropouts.

    The heap holds one key ``(-demand / fewest, fewest, name)`` per model. Whole copies,
    the usual case, cost O(log models) each and are counted in one batch at the end."""
    covered = [s for s in work.specs.values()
               if s.num_layers > 0 and s.demand > 0 and min(work.counts[s.name]) > 0]
    heap = [(-s.demand / min(work.counts[s.name]), min(work.counts[s.name]), s.name) for s in covered]
    heapq.heapify(heap)
    whole: dict[str, list[int]] = {s.name: [] for s in covered}   # not yet in ``counts``
    smallest = _smallest_layer_bytes(covered)
    nodes, added, specs = work.nodes, work.added, work.specs
    for i in work.order:
        node = nodes[i]
        if node.assignments or i in added or not heap:
            continue
        free = memory_budget_bytes(node.vram_bytes)   # an idle node's whole budget
        if free < smallest.get(node.quantization, _NEVER):
            continue
        key = heap[0]
        spec = specs[key[2]]
        per_layer = layer_bytes(node, spec)
        if 0 < per_layer <= free:   # the usual case: the first model fits; its key is replaced in place
            picked = key, spec, min(free // per_layer, spec.num_layers)
            replace = True
        else:
            picked, replace = _pick_model(heap, specs, node, free), False
            if picked is None:
                continue
        (_, fewest, name), spec, width = picked
        if width == spec.num_layers:
            whole[name].append(i)
            fewest += 1
        else:
            counts, lift = work.counts[name], len(whole[name])
            start = min(counts.index(fewest - lift), spec.num_layers - width)
            work.add(i, spec, start, start + width, redundant=True)
            fewest = min(counts) + lift
        (heapq.heapreplace if replace else heapq.heappush)(heap, (-spec.demand / fewest, fewest, name))
    for name, idle in whole.items():
        if idle:
            work.add_whole_copies(work.specs[name], idle)


def _best_position(profile: list[int], old: LayerRange, speed: int) -> tuple[int, int]:
    """Best ``(bottleneck, start)`` after moving a shard of ``speed`` from ``old`` to any
    same-width window; keeps ``old.start`` unless another start is strictly better."""
    base = profile[:]
    base[old.start:old.end] = [t - speed for t in base[old.start:old.end]]
    width = len(old)
    before = [_NEVER, *accumulate(base, min)]                  # before[s] = min(base[:s])
    after = [*accumulate(reversed(base), min)][::-1] + [_NEVER]  # after[s] = min(base[s:])
    best, best_start = min(profile), old.start
    for s in range(len(base) - width + 1):
        value = min(before[s], after[s + width], min(base[s:s + width]) + speed)
        if value > best:
            best, best_start = value, s
    return best, best_start


def _may_gain(low: list[int], old: LayerRange) -> bool:
    """Cheap necessary test for a move to lift every layer of ``low`` (sorted, non-empty) over
    the threshold: one inside ``old`` stays low wherever the shard goes, and all of them
    must fit one ``old``-wide window."""
    inside = bisect_left(low, old.start)
    return low[-1] - low[0] < len(old) and (inside == len(low) or low[inside] >= old.end)


def _move_managed(work: _Work, spec: ModelSpec, min_gain: float) -> bool:
    """Apply the single best managed move of ``spec`` if it raises the bottleneck
    (slowest layer's tokens/s) by more than ``min_gain``; return whether one was made."""
    profile = work.profile[spec.name]
    bottleneck = min(profile)
    threshold = bottleneck * (1 + min_gain)
    low, best = None, None
    for k, (i, a) in enumerate(work.movable[spec.name]):
        speed = _milli(work.nodes[i].tokens_per_s)
        if bottleneck + speed <= threshold:   # the slowest layer cannot clear the threshold
            continue
        low = low or [layer for layer, t in enumerate(profile) if t <= threshold]
        if not _may_gain(low, a.layers):
            continue
        value, start = _best_position(profile, a.layers, speed)
        rank = (-value, work.nodes[i].node_id, a.layers.start)
        if value > threshold and (best is None or rank < best[0]):
            best = (rank, k, Assignment(a.model, LayerRange(start, start + len(a.layers)), "managed"))
    if best is not None:
        work.move(best[1], best[2])
    return best is not None


def _rebalance_managed(work: _Work, min_gain: float) -> None:
    """Move managed shards of changed models until no move clears ``min_gain`` (a fixed point)."""
    for name, movable in work.movable.items():
        if name not in work.dirty or not movable or work.specs[name].num_layers < 1:
            continue
        work.dirty.discard(name)
        for _ in range(16 * len(movable)):   # each move raises the bottleneck, so this ends sooner
            if not _move_managed(work, work.specs[name], min_gain):
                break


def _smallest_layer_bytes(specs: Iterable[ModelSpec]) -> dict[str, int]:
    """Quantization -> bytes of the smallest layer among ``specs``."""
    sizes = [(quant, size) for spec in specs for quant, size in spec.bytes_per_layer.items() if size > 0]
    return {quant: min(size for q, size in sizes if q == quant) for quant, _ in sizes}


def _idle_reason(work: _Work, i: int, smallest: dict[str, int]) -> str:
    """Why node ``i`` received nothing in this plan."""
    node = work.nodes[i]
    used = len(node.assignments) + len(work.added.get(i, ()))
    if not node.accepts_placement:
        return "not accepting placement"
    if used >= node.max_loaded_shards:
        return f"no free shard slot ({used}/{node.max_loaded_shards} used)"
    if work.free_bytes(i) < smallest.get(node.quantization, _NEVER):
        return "memory budget full"
    if used:
        return f"no gap it can fill; keeps {used} shard(s), redundancy goes to idle nodes"
    return "no gap it can fill and no fully covered model fits"


def _record_moves(work: _Work, i: int, loads: list, drops: list) -> tuple[tuple[Assignment, ...], list[str]]:
    """Node ``i``'s own shards after managed moves, with each move recorded as drop + load."""
    node, lines = work.nodes[i], []
    for old, new in zip(node.assignments, work.kept[i]):
        if old != new:
            drops.append((node.node_id, old))
            loads.append((node.node_id, new))
            lines.append(f"moved managed {old.model} {old.layers} -> {new.layers} to raise its bottleneck")
    return tuple(work.kept[i]), lines


def _finish(work: _Work) -> PlacementPlan:
    """Turn the scratch state into a plan: full sets, load/drop lists (in node order), reasons."""
    final = {n.node_id: n.assignments for n in work.nodes}
    loads, drops, notes = [], [], {}
    nodes, kept = work.nodes, work.kept
    for i in sorted(work.added.keys() | kept.keys()):
        node, added = nodes[i], work.added.get(i, ())
        nid = node.node_id
        if len(added) == 1 and i not in kept:   # most nodes a plan touches: one new shard, nothing moved
            note, a = added[0]
            loads.append((nid, a))
            final[nid] = node.assignments + (a,)
            notes[i] = note
            continue
        shards, lines = _record_moves(work, i, loads, drops) if i in kept else (node.assignments, [])
        for note, a in added:
            loads.append((nid, a))
            lines.append(note)
            shards += (a,)
        final[nid] = shards
        if lines:
            notes[i] = lines[0] if len(lines) == 1 else "; ".join(lines)
    return PlacementPlan(MappingProxyType(final), tuple(loads), tuple(drops), _Reasons(work, notes),
                         MappingProxyType({name: tuple(c) for name, c in work.counts.items()}))


class _Reasons(Mapping):
    """node_id -> reason. Nodes the plan touched carry their note; the reason a node got
    nothing is worked out on first access only (in a large settled network nearly every
    node is untouched, and operators read a handful of them)."""

    def __init__(self, work: _Work, notes: dict[int, str]) -> None:
        self._work, self._notes = work, notes
        self._index = {n.node_id: i for i, n in enumerate(work.nodes)}
        self._smallest: dict[str, int] | None = None

    def __getitem__(self, node_id: str) -> str:
        i = self._index[node_id]
        if i in self._notes:
            return self._notes[i]
        if self._smallest is None:
            self._smallest = _smallest_layer_bytes(self._work.specs.values())
        return _idle_reason(self._work, i, self._smallest)

    def get(self, node_id: str, default: str | None = None) -> str | None:
        """The reason of ``node_id`` (``default`` for a node not in the plan); a node the plan
        touched is read without the abstract mapping's lookup chain (a rebalance reads one per
        directive, thousands at once)."""
        i = self._index.get(node_id)
        if i is None:
            return default
        note = self._notes.get(i)
        return note if note is not None else self[node_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def plan_placement(nodes: Sequence[NodeState], models: Sequence[ModelSpec], *,
                   min_gain: float = 0.1) -> PlacementPlan:
    """Plan shard placement for ``nodes`` over ``models`` (ADR-0003).

    Never exceeds a node's memory budget (``floor(vram_bytes * 0.8)`` bytes, existing
    shards included) or its ``max_loaded_shards``; adds nothing to a node that does not
    accept placement; never moves ``pinned`` or ``bootstrap`` shards. New shards are
    ``bootstrap``. A ``managed`` shard moves only if the model's bottleneck throughput
    (tokens/s of its slowest layer) grows by more than ``min_gain`` (0.1 = 10 %).
    Models go in order of descending ``demand``, then name; ties between nodes by node_id.
    Re-planning the state the plan produces yields no loads and no drops.

    Raises:
        ValueError: if ``min_gain`` is negative.
    """
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    ordered = sorted(models, key=lambda m: (-m.demand, m.name))
    work = _Work(nodes, ordered)
    for spec in ordered:
        if spec.num_layers > 0:
            _fill_gaps(work, spec)
    _rebalance_managed(work, min_gain)
    _add_redundancy(work)
    _rebalance_managed(work, min_gain)
    return _finish(work)


def apply_plan(nodes: Sequence[NodeState], plan: PlacementPlan) -> list[NodeState]:
    """``nodes`` with their assignments replaced by the plan's desired sets (others unchanged)."""
    return [n._replace(assignments=tuple(plan.assignments[n.node_id]))
            if n.node_id in plan.assignments else n for n in nodes]
