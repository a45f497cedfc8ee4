"""Rebalance: turn the registry into placement inputs, plan, and queue directives.

Steps: placement inputs (a snapshot of the registry), the pure plan, the directives that carry
it out (with demand moves), one batched store write (:meth:`TrackerStore.add_directives`), and
:func:`apply_rebalance` (reasons, move cooldowns). The tracker's loop runs the plan and the write
on worker threads (:func:`rebalance_off_loop`); :func:`rebalance` runs all on the caller's thread.

Placement itself is the pure :func:`meshnet.tracker.placement.plan_placement`; this module
only translates. A node's shards count as its assignments together with the LOAD_SHARD
directives still open for it (so a pending load is never issued twice), minus open
DROP_SHARDs. A node whose load failed recently gets no new placement for a cooldown.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from dataclasses import dataclass, field

from meshnet.layers import LayerRange
from meshnet.protocol.control import OPEN_STATUSES, TIERS, Directive
from meshnet.tracker import placement, policy
from meshnet.tracker.service import TrackerService
from meshnet.tracker.store import NewDirective

log = logging.getLogger(__name__)


def _assignments(node, open_directives: list[Directive]) -> tuple[placement.Assignment, ...]:
    """The node's shards, plus its open LOAD_SHARDs, minus its open DROP_SHARDs."""
    if not open_directives and len(node.shards) == 1:  # most held nodes: one shard, nothing pending
        s = node.shards[0]
        return (_assignment(s.model, s.layers, s.tier if s.tier in TIERS else "pinned"),)
    held = {(s.model, s.layers): s.tier for s in node.shards}
    for d in sorted(open_directives, key=lambda d: d.id):
        if not d.model or d.layers is None:
            continue
        key = (d.model, d.layers)
        if d.type == "LOAD_SHARD":
            held.setdefault(key, d.tier or "bootstrap")
        elif d.type == "DROP_SHARD":
            held.pop(key, None)
    return tuple(_assignment(m, r, t if t in TIERS else "pinned") for (m, r), t in sorted(held.items()))


@functools.lru_cache(maxsize=1 << 16)
def _assignment(model: str, layers: LayerRange, tier: str) -> placement.Assignment:
    """One shared frozen Assignment per shard (a lookup costs a quarter of building one, and the
    snapshot of a large network meets the same shards on many nodes)."""
    return placement.Assignment(model, layers, tier)


def measured_bytes_per_layer(node) -> dict[str, int]:
    """Model -> bytes per layer ``node`` (a NodeRecord) measured holding it in its recipe: the
    largest ``ceil(resident_bytes / layers)`` over its shards' capability reports (ADR-0039).
    Shards without a measured figure, or run in another recipe, add nothing."""
    measured: dict[str, int] = {}
    for s in node.shards:
        report = s.report
        if report is None or not report.resident_bytes or s.quantization != node.quantization:
            continue
        per_layer = -(-report.resident_bytes // len(s.layers))
        measured[s.model] = max(measured.get(s.model, 0), per_layer)
    return measured


def store_inputs(service: TrackerService) -> tuple[dict[str, list[Directive]], set[str]]:
    """What placement reads from the store (safe on a worker thread): each node's open
    directives, and the nodes whose ``LOAD_SHARD`` failed within the cooldown. Read once per
    rebalance, not once per node."""
    open_by_node: dict[str, list[Directive]] = {}
    for d in service.store.directives(statuses=OPEN_STATUSES, limit=1_000_000):
        open_by_node.setdefault(d.node_id, []).append(d)
    since = time.time() - service.settings.load_failure_cooldown_s
    failed_recently = {d.node_id for d in service.store.directives(statuses=("failed",), updated_after=since,
                                                                   limit=1_000_000)
                       if d.type == "LOAD_SHARD"}
    return open_by_node, failed_recently


def _model_specs(service: TrackerService) -> list[placement.ModelSpec]:
    return [placement.ModelSpec(m.name, m.num_layers, m.bytes_per_layer, service.load_rate(m.name))
            for m in service.tracked_models()]


def _node_states(nodes, known: set[str], open_by_node: dict[str, list[Directive]],
                 failed_recently: set[str]) -> list[placement.NodeState]:
    """Placement's view of each of ``nodes`` (NodeRecords); an idle node with nothing open, most of
    a large network's, is made without translating anything."""
    states, make = [], placement.NodeState
    for node in nodes:
        accepts = _accepts(node, failed_recently)
        if node.shards or node.node_id in open_by_node:
            states.append(_node_state(node, known, open_by_node.get(node.node_id, []), accepts))
        else:
            states.append(make(node.node_id, node.vram_bytes, node.quantizations[0],
                               node.benchmark_tokens_per_sec or 1.0, node.max_loaded_shards, (), accepts))
    return states


def _accepts(node, failed_recently: set[str]) -> bool:
    """Whether ``node`` (a NodeRecord) may be given shards now."""
    return (node.accepts_placement and not node.draining and node.reachable and node.quarantine is None
            and node.node_id not in failed_recently)


def _node_state(node, known: set[str], open_directives: list[Directive], accepts: bool) -> placement.NodeState:
    """A node that holds shards or has directives open: its assignments translated."""
    assignments = _assignments(node, open_directives)
    if len(assignments) != 1 or assignments[0].model not in known:
        assignments = tuple(a for a in assignments if a.model in known)
    # a heartbeat's measured figure is every shard's (NodeRecord.tokens_per_s): no need to ask each one
    shards = node.shards
    speed = node.stats.tokens_per_s if shards else 0.0
    if not speed:
        speed = (node.tokens_per_s(shards[0]) if len(shards) == 1
                 else max((node.tokens_per_s(s) for s in shards), default=node.benchmark_tokens_per_sec or 1.0))
    if node.claims_refuted:  # this tracker's probes refuted a claim of it: its judged figure (ADR-0068)
        speed = min(speed, node.speed_cap)
    return placement.NodeState(node.node_id, node.vram_bytes, node.quantization, speed, node.max_loaded_shards,
                               assignments, accepts, measured_bytes_per_layer(node))


def placement_inputs(service: TrackerService) -> tuple[list[placement.NodeState], list[placement.ModelSpec]]:
    """Placement's view of the registry, all on the calling thread (tests, tools; the tracker's
    loop uses :func:`placement_inputs_async`)."""
    models = _model_specs(service)
    known = {m.name for m in models}
    open_by_node, failed_recently = store_inputs(service)
    return _node_states(service.nodes.values(), known, open_by_node, failed_recently), models


#: nodes turned into placement states between two yields of the event loop (about 4 ms of work)
SNAPSHOT_BATCH = 1000


async def placement_inputs_async(service: TrackerService) -> tuple[list[placement.NodeState],
                                                                   list[placement.ModelSpec]]:
    """:func:`placement_inputs` for the event loop: the store reads on a worker thread, the
    registry snapshot on the loop (the service is not thread-safe) in batches of
    :data:`SNAPSHOT_BATCH` nodes with a yield between them, so heartbeats are served meanwhile
    (the longest loop block stays a few milliseconds at 10,000 nodes, ADR-0054). A node that
    leaves during the snapshot is left out; one that joins waits for the next rebalance."""
    models = _model_specs(service)
    known = {m.name for m in models}
    open_by_node, failed_recently = await asyncio.to_thread(store_inputs, service)
    ids, states = list(service.nodes), []
    for start in range(0, len(ids), SNAPSHOT_BATCH):
        batch = [service.nodes.get(node_id) for node_id in ids[start:start + SNAPSHOT_BATCH]]
        states += _node_states([n for n in batch if n is not None], known, open_by_node, failed_recently)
        await asyncio.sleep(0)
    return states, models


@dataclass
class RebalanceResult:
    """One rebalance: the plan, the directives it queues (in order), the demand moves, and the
    lease term it was planned under (its writes' fencing token, ADR-0054; None on sqlite)."""

    plan: placement.PlacementPlan
    directives: list[NewDirective] = field(default_factory=list)
    moves: list[tuple[str, tuple, placement.Assignment]] = field(default_factory=list)
    term: int | None = None


def _new(node_id: str, type_: str, a: placement.Assignment, tier: str | None, reason: str) -> NewDirective:
    start, end = a.layers.to_inclusive()
    return NewDirective(node_id, type_, a.model, start, end, tier, reason)


def plan_rebalance(service: TrackerService) -> RebalanceResult:
    """Plan placement and demand moves over the live registry; changes nothing (call it on the
    event loop: it reads the service's state)."""
    nodes, models = placement_inputs(service)
    return directives_for(service, nodes, models, placement.plan_placement(nodes, models), term=service.store.term)


def directives_for(service: TrackerService, nodes: list[placement.NodeState], models: list[placement.ModelSpec],
                   plan: placement.PlacementPlan, *, term: int | None) -> RebalanceResult:
    """The directives that carry out ``plan`` (planned over ``nodes`` and ``models``), and the
    demand moves after it, under lease ``term`` (its writes' fencing token); changes nothing (on the
    event loop: it reads the service's state)."""
    # a model tracked only because chat demand asked for it is placed as `managed` (ADR-0026)
    by_demand = {name for name, source in service.store.model_sources().items() if source == "demand"}
    result, reasons = RebalanceResult(plan, term=term), plan.reasons
    shards: dict[int, tuple] = {}   # id of a load's Assignment -> its fields (a large plan's loads share a few)
    for node_id, a in plan.loads:
        fields = shards.get(id(a))
        if fields is None:
            tier = "managed" if a.tier == "bootstrap" and a.model in by_demand else a.tier
            fields = shards[id(a)] = (a.model, a.layers.start, a.layers.end - 1, tier)
        result.directives.append(NewDirective(node_id, "LOAD_SHARD", *fields, reasons.get(node_id, "")))
    for node_id, a in plan.drops:
        result.directives.append(_new(node_id, "DROP_SHARD", a, a.tier, reasons.get(node_id, "")))
    result.moves = demand_moves(service, nodes, models, plan)
    for node_id, old, new in result.moves:
        for a in old:
            result.directives.append(_new(node_id, "DROP_SHARD", a, a.tier, f"moved to {new.model} by demand"))
        result.directives.append(_new(node_id, "LOAD_SHARD", new, "managed", f"demand for {new.model}"))
    return result


#: loads a rebalance logs one line each at INFO; past it, one summary line (each load at DEBUG)
LOGGED_LOADS = 20


def _log_loads(loads: tuple[tuple[str, placement.Assignment], ...]) -> None:
    """A line per load while there are few; a summary past :data:`LOGGED_LOADS`: at 10,000 nodes a
    cold rebalance queues 7,000 loads, and a line each at the default level kept the event loop
    formatting and writing for longer than the whole rebalance takes."""
    level = logging.INFO if len(loads) <= LOGGED_LOADS else logging.DEBUG
    if log.isEnabledFor(level):
        for node_id, a in loads:
            log.log(level, "LOAD_SHARD %s %s → %s (%s)", a.model, a.layers, node_id, a.tier)
    if len(loads) > LOGGED_LOADS:
        models = collections.Counter(a.model for _, a in loads)
        log.info("rebalance queued %d loads (%s)", len(loads),
                 ", ".join(f"{model} {count}" for model, count in models.most_common()))


def apply_rebalance(service: TrackerService, result: RebalanceResult) -> None:
    """Record a persisted rebalance in the service's memory (on the event loop). A node that left
    while the directives were written gets its new ones failed at once, as a dropout would."""
    plan = result.plan
    _log_loads(plan.loads)
    service.plan_reasons = plan.reasons  # read per node by GET /v1/nodes (computed lazily)
    for node in service.nodes.values():
        node.reason = ""
    now = time.monotonic()
    for node_id, old, new in result.moves:
        if node_id in service.nodes:
            service.nodes[node_id].last_move_s = now
            service.nodes[node_id].reason = f"moved to {new.model} {new.layers} by demand (ADR-0005)"
        log.info("demand move: %s from %s to %s %s", node_id, [a.model for a in old], new.model, new.layers)
    for node_id in {d.node_id for d in result.directives} - service.nodes.keys():
        service.store.fail_open(node_id, "node left during the rebalance", term=result.term)


def rebalance(service: TrackerService) -> placement.PlacementPlan:
    """Plan placement over the live registry and queue the resulting directives, all at once on
    the calling thread (tests, tools; the tracker's loop uses :func:`rebalance_off_loop`)."""
    service.dirty = False
    result = plan_rebalance(service)
    service.store.add_directives(result.directives, term=result.term)
    service.note_queued(d.node_id for d in result.directives)
    apply_rebalance(service, result)
    return result.plan


async def rebalance_off_loop(service: TrackerService) -> placement.PlacementPlan:
    """:func:`rebalance` with its two heavy steps on worker threads (ADR-0037).

    Only pure work and the store leave the event loop; the service is not thread-safe, so every
    read and change of its state stays on the loop:

    1. thread: the store's directives; loop: a snapshot of frozen :class:`placement.NodeState`, in
       batches with yields between them (:func:`placement_inputs_async`);
    2. thread: :func:`placement.plan_placement` over that snapshot (pure);
    3. loop: :func:`directives_for` (demand moves read the service);
    4. thread: :meth:`TrackerStore.add_directives`, one transaction under the store's lock;
    5. loop: :func:`apply_rebalance`.

    Heartbeats keep being served meanwhile. One that reads the store while the batch is written
    waits for its commit, then sees all of it or none. The plan is as old as the snapshot: a node
    that left meanwhile has its new directives failed at once (step 5); any join or leave marks
    the service dirty again, for the next round.
    """
    service.dirty = False
    term = service.store.term  # the lease this plan is made under: its writes are fenced by it
    nodes, models = await placement_inputs_async(service)
    plan = await asyncio.to_thread(placement.plan_placement, nodes, models)
    result = directives_for(service, nodes, models, plan, term=term)
    await asyncio.to_thread(service.store.add_directives, result.directives, term=result.term)
    service.note_queued(d.node_id for d in result.directives)
    apply_rebalance(service, result)
    return result.plan


def demand_moves(service: TrackerService, nodes: list[placement.NodeState], models: list[placement.ModelSpec],
                 plan: placement.PlacementPlan) -> list[tuple[str, tuple, placement.Assignment]]:
    """Managed nodes to move to models whose queued demand left gaps after placement.

    Only nodes whose every shard is ``managed`` and of one model are candidates; the safety
    policy (:func:`policy.pick_managed_nodes`: the old model keeps >= 3 copies, the new model's
    demand is >= 1.5x, cooldown elapsed) decides (ADR-0005). Returns ``(node, old shards, new shard)``.
    """
    counts = {m.name: list(plan.coverage[m.name]) for m in models if m.name in plan.coverage}
    if len(counts) < len(models):  # a plan made without its coverage map
        ranges: dict[str, list[LayerRange]] = {m.name: [] for m in models}
        for shards in plan.assignments.values():
            for a in shards:
                if a.model in ranges:
                    ranges[a.model].append(a.layers)
        counts = {m.name: placement.coverage_counts(m.num_layers, ranges[m.name]) for m in models}
    copies = {name: min(c) if c else 0 for name, c in counts.items()}
    demand = {m.name: m.demand for m in models}
    now, moves, moved = time.monotonic(), [], set()
    for spec in sorted(models, key=lambda m: -service.demand_rate(m.name)):
        gaps = placement.find_gaps(spec.num_layers, counts[spec.name])
        if not gaps or service.demand_rate(spec.name) <= 0:
            continue
        candidates = []
        for n in nodes:
            shards = plan.assignments.get(n.node_id, ())
            record = service.nodes.get(n.node_id)  # None: it left since the snapshot was taken
            if (record is None or n.node_id in moved or not n.accepts_placement or not shards
                    or any(a.tier != "managed" for a in shards) or len({a.model for a in shards}) != 1):
                continue
            last = record.last_move_s
            candidates.append(policy.MoveCandidate(n.node_id, "managed", shards[0].model,
                                                   None if last is None else now - last, n.tokens_per_s))
        by_id = {n.node_id: n for n in nodes}
        for pick in policy.pick_managed_nodes(spec.name, candidates, needed=len(gaps), model_copies=copies,
                                              model_demand=demand):
            node, gap = by_id[pick.node_id], gaps.pop(0)
            per_layer = placement.layer_bytes(node, spec)  # measured when larger; 0: no size for the recipe
            fit = placement.max_assignable_layers(node.vram_bytes, per_layer) if per_layer > 0 else 0
            if fit < 1:
                continue
            new = placement.Assignment(spec.name, LayerRange(gap.start, min(gap.end, gap.start + fit)), "managed")
            moves.append((pick.node_id, plan.assignments[pick.node_id], new))
            moved.add(pick.node_id)
            copies[pick.from_model] -= 1
            if not gaps:
                break
    return moves
