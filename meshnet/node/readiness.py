"""Node readiness: can this node take part in a chat now, and if not, why (ADR-0032).

Liveness (``GET /v1/health``) only says the process runs. Readiness (``GET /v1/ready``)
says whether work sent here now would be served: shards loaded and passed by doctor,
the tracker reachable (so that routes exist and the node is known), not draining, and for
an entry node that a route covers the rest of its model. :func:`node_readiness` is the
decision as a pure function over those facts; :func:`gather_facts` collects them from a
running node.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange


@dataclass(frozen=True)
class ShardFact:
    """One loaded shard: inclusive public layers, whether it is an entry, its doctor verdict.

    ``passed`` is None while no capability report exists; ``route_error`` (entry shards
    only) is None when a route for the rest of the model exists, else why not.
    """

    model: str
    shard_start: int
    shard_end: int
    entry: bool
    passed: bool | None
    reason: str = ""
    route_error: str | None = None


@dataclass(frozen=True)
class TrackerFact:
    """The node's link to its tracker: ``url`` (None: standalone), seconds since the tracker
    last accepted a heartbeat (None: never), the latest error, and the allowed age, seconds."""

    url: str | None
    heartbeat_age_s: float | None = None
    last_error: str | None = None
    timeout_s: float = 25.0


@dataclass(frozen=True)
class NodeFacts:
    draining: bool
    shards: list[ShardFact] = field(default_factory=list)
    tracker: TrackerFact = TrackerFact(None)
    num_layers: dict[str, int] = field(default_factory=dict)  # model -> layers (standalone entry check)


def node_readiness(facts: NodeFacts) -> dict:
    """``{"ready": bool, "reasons": [str, ...]}``: ready exactly when ``reasons`` is empty.

    Reasons, in this order: draining; no shard loaded; a shard whose capability check is
    missing or failed; the tracker unreachable or silent past ``timeout_s`` (only with a
    tracker); an entry shard with no route for the rest of its model (with a tracker), or
    a standalone entry shard that does not hold the whole model.
    """
    reasons: list[str] = []
    if facts.draining:
        reasons.append("draining: the node is shutting down and takes no new sessions")
    if not facts.shards:
        reasons.append("no shard loaded")
    for s in facts.shards:
        name = f"{s.model} {s.shard_start}-{s.shard_end}"
        if s.passed is None:
            reasons.append(f"shard {name}: capability check (doctor) not done yet")
        elif not s.passed:
            reasons.append(f"shard {name}: capability check failed: {s.reason or 'no reason given'}")
    t = facts.tracker
    if t.url is not None:
        if t.last_error is not None:
            reasons.append(f"tracker {t.url} unreachable: {t.last_error}")
        elif t.heartbeat_age_s is None:
            reasons.append(f"not registered with tracker {t.url} yet")
        elif t.heartbeat_age_s > t.timeout_s:
            reasons.append(f"tracker {t.url} has not accepted a heartbeat for {t.heartbeat_age_s:.0f} s")
    for s in facts.shards:
        if not s.entry:
            continue
        if t.url is not None and s.route_error is not None:
            reasons.append(f"{s.model}: no route for the layers after {s.shard_end}: {s.route_error}")
        elif t.url is None and s.shard_end + 1 < facts.num_layers.get(s.model, s.shard_end + 1):
            reasons.append(f"{s.model}: standalone entry holds layers 0-{s.shard_end} of "
                           f"{facts.num_layers[s.model]} and has no tracker to route the rest")
    return {"ready": not reasons, "reasons": reasons}


async def gather_facts(node, route_timeout_s: float = 3.0) -> NodeFacts:
    """The facts :func:`node_readiness` decides on, from ``node`` (the app's NodeContext). An entry
    shard that needs remote layers asks the tracker for a route, bounded by ``route_timeout_s``
    seconds (a slow tracker is then a reason, not a hung probe)."""
    agent = node.agent
    shards = []
    for key, slot in list(node.runtime.slots.items()):
        start, end = slot.layers.to_inclusive()
        report = node.reports.get(key)
        route_error = None
        if slot.shard.is_entry and agent is not None and slot.layers.end < slot.shard.num_layers:
            try:
                async with asyncio.timeout(route_timeout_s):  # not wait_for: it can swallow a cancel on 3.11
                    await agent.route(slot.model, LayerRange(slot.layers.end, slot.shard.num_layers), frozenset())
            except MeshnetError as exc:
                route_error = exc.message
            except asyncio.TimeoutError:
                route_error = f"route lookup took over {route_timeout_s:.0f} s"
        shards.append(ShardFact(slot.model, start, end, slot.shard.is_entry,
                                None if report is None else report.passed,
                                "" if report is None else report.reason, route_error))
    tracker = TrackerFact(None)
    if agent is not None:
        tracker = TrackerFact(node.settings.tracker_url, agent.heartbeat_age_s(), agent.last_error,
                              timeout_s=2.5 * agent.interval_s)
    elif node.settings.tracker_url:
        tracker = TrackerFact(node.settings.tracker_url, None, "no tracker agent is running")
    return NodeFacts(draining=node.drain.draining, shards=shards, tracker=tracker,
                     num_layers={s.model: s.shard.num_layers for s in node.runtime.slots.values()})
