"""Route choice: which nodes run which layers of one generation.

A route is an ordered list of :class:`Hop` covering the layers ``[start_layer,
num_layers)`` of a model. It is a shortest path over layer boundaries, where running
``k`` layers on a node costs that node's measured per-layer time (slowed by its load)
plus one network latency. The cost model is docs/adr/0004-route-cost-model.md; hops that
start inside a node's shard are docs/adr/0012-overlapping-shards.md.

How: candidates dominated by another are dropped (:func:`_undominated`), then one
left-to-right sweep over the boundaries where shards start or end finds the cheapest
route; every edge points forward, so the sweep is Dijkstra on a DAG (:class:`_Riders`).

Pure: no I/O, no clock. Callers pass measured numbers in :class:`ShardCandidate`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from meshnet.errors import ModelNotRoutable
from meshnet.layers import LayerRange
from meshnet.protocol.route import Hop

__all__ = [
    "Hop",
    "NoRoute",
    "ShardCandidate",
    "choose_route",
    "estimate_hop_seconds",
    "relay_latency_s",
    "seconds_per_layer",
]

#: Default extra cost per request already in flight on a node (ADR-0004).
LOAD_PENALTY = 0.5
#: Default seconds a node that failed as a hop is avoided (ADR-0004).
FAILURE_COOLDOWN_S = 30.0
# Costs are compared as integer picoseconds so that equal routes tie exactly and the
# tie-break rules (fewer hops, lower in-flight, node id) decide, not float noise.
_PS_PER_S = 10**12
# Past this many undominated candidates, the rest are routed over without pruning.
_MAX_FRONTIER = 64
# Cost of a rider not boarded yet, or retired: larger than any real cost.
_UNBOARDED = float("inf")


@dataclass(frozen=True)
class ShardCandidate:
    """One node able to serve part of a route, with its measured numbers.

    Attributes:
        node_id: the node's id.
        endpoint: base URL of the node.
        layers: the shard the node serves (half-open).
        tokens_per_s: EMA throughput for the whole shard, tokens/s through all its layers.
        latency_s: EMA per-hop network latency, seconds.
        in_flight: requests currently running through the node.
        last_failure_age_s: seconds since the node last failed as a hop; None = never.
    """

    node_id: str
    endpoint: str
    layers: LayerRange
    tokens_per_s: float
    latency_s: float = 0.0
    in_flight: int = 0
    last_failure_age_s: float | None = None


class NoRoute(ModelNotRoutable):
    """``[start_layer, num_layers)`` cannot be covered by the usable candidates.

    Attributes:
        gap_start: the first layer no route can reach.
    """

    def __init__(self, gap_start: int, num_layers: int) -> None:
        super().__init__(
            f"no route: layer {gap_start} of {num_layers} is not served by any usable node",
            hint="wait for the tracker to place a shard there, or start a node serving it",
        )
        self.gap_start = gap_start


#: the least a relayed hop is charged for its relay's extra leg, seconds (ADR-0045)
RELAY_LATENCY_FLOOR_S = 0.002


def relay_latency_s(relay_url: str | None, relay_rtt_s: float) -> float:
    """Extra seconds per token a hop pays when its node is reached through a relay (ADR-0045).

    A relayed call travels caller → relay → node and back: on top of the direct path it crosses
    the relay ↔ node leg once each way, which is the tunnel's round trip ``relay_rtt_s`` as the
    node measured it (at least :data:`RELAY_LATENCY_FLOOR_S`, so that of two equal holders the
    directly reached one wins). 0 for a node reached directly (``relay_url`` None).
    """
    if relay_url is None:
        return 0.0
    return max(relay_rtt_s, RELAY_LATENCY_FLOOR_S) if math.isfinite(relay_rtt_s) else RELAY_LATENCY_FLOOR_S


def seconds_per_layer(candidate: ShardCandidate, *, load_penalty: float = LOAD_PENALTY) -> float:
    """Seconds per token per layer on ``candidate``, load included (ADR-0004).

    A node measuring ``T`` tokens/s over ``L`` layers spends ``1/T`` s per token for all
    ``L`` layers, so ``(1/T)/L`` s per layer; that is multiplied by
    ``1 + load_penalty * in_flight``. Returns ``inf`` when ``tokens_per_s <= 0``.
    """
    if candidate.tokens_per_s <= 0:
        return float("inf")
    load = 1.0 + load_penalty * max(candidate.in_flight, 0)
    return load / (candidate.tokens_per_s * len(candidate.layers))


def estimate_hop_seconds(candidate: ShardCandidate, n_layers: int, *,
                         load_penalty: float = LOAD_PENALTY) -> float:
    """Estimated seconds per token for ``n_layers`` layers on ``candidate`` (ADR-0004).

    ``n_layers * seconds_per_layer + latency_s``; network latency is not scaled by load.
    """
    compute_s = n_layers * seconds_per_layer(candidate, load_penalty=load_penalty)
    return compute_s + max(candidate.latency_s, 0.0)


def choose_route(num_layers: int, candidates: Sequence[ShardCandidate], *, start_layer: int = 0,
                 exclude: Collection[str] = (), failure_cooldown_s: float = FAILURE_COOLDOWN_S,
                 load_penalty: float = LOAD_PENALTY) -> list[Hop]:
    """Cheapest hops covering layers ``[start_layer, num_layers)`` (ADR-0004, ADR-0012).

    Nodes in ``exclude`` are never used, nor are candidates without a measured speed
    (``tokens_per_s <= 0``) or with a non-finite ``latency_s``. Nodes whose last failure
    is younger than ``failure_cooldown_s`` seconds are a last resort: they are used only
    when no route exists without them, and then every usable node competes on cost.

    Per token cost is the sum of :func:`estimate_hop_seconds` over the hops, compared in
    whole picoseconds per layer. Equal costs go to fewer hops, then lower total
    ``in_flight``, then the smaller sequence of node ids. Consecutive hops never share a
    node. Shards reaching past ``num_layers`` are clipped to it.

    Raises:
        NoRoute: with ``gap_start`` set, when the layers cannot be covered.
        ValueError: on a bad layer count or a node id listed twice.
    """
    if not 0 <= start_layer < num_layers:
        raise ValueError(f"start_layer {start_layer} outside [0, {num_layers})")
    ids = [c.node_id for c in candidates]
    if len(set(ids)) != len(ids):
        raise ValueError("each node may appear only once among the candidates of a model")
    excluded = set(exclude)
    usable = [c for c in candidates
              if c.node_id not in excluded and c.tokens_per_s > 0 and math.isfinite(c.latency_s)]
    healthy = [c for c in usable if not _cooling(c, failure_cooldown_s)]
    try:
        return _shortest_route(num_layers, start_layer, healthy, load_penalty)
    except NoRoute:
        if len(healthy) == len(usable):
            raise
    return _shortest_route(num_layers, start_layer, usable, load_penalty)


def _cooling(candidate: ShardCandidate, failure_cooldown_s: float) -> bool:
    age = candidate.last_failure_age_s
    return age is not None and age < failure_cooldown_s


class _Node(NamedTuple):
    """A usable candidate with its numbers in the sweep's units (a tuple: built 1,000s of times)."""

    per_layer_ps: float
    latency_ps: float
    first: int  # first boundary it can be boarded at (its start, clipped to start_layer)
    last: int  # its end, clipped to num_layers
    candidate: ShardCandidate


@dataclass(frozen=True)
class _Arrival:
    """Best way found to arrive at a layer boundary, with a back-pointer."""

    cost_ps: float  # whole picoseconds per token, see _to_ps
    rank: tuple  # (hops, total in_flight, node ids in order): the tie-break
    rider: int | None  # index of the node that carried us here; None at start_layer
    boarded_at: int  # boundary where that node was boarded


def _to_ps(seconds: float) -> float:
    """Whole picoseconds held in a float: sums stay exact below 2**53 ps (about 2.5 h)."""
    return float(round(max(seconds, 0.0) * _PS_PER_S))


def _rank(arrival: _Arrival, node: ShardCandidate) -> tuple:
    """Tie-break of riding ``node`` after ``arrival``: (hops, total in_flight, node ids)."""
    hops, in_flight, ids = arrival.rank
    return hops + 1, in_flight + node.in_flight, (*ids, node.node_id)


class _Riders:
    """The nodes whose shard spans the current boundary, held as parallel lists.

    ``cost[k]`` is the cheapest cost (ps) of being on rider ``k`` at the current boundary,
    boarding included. Where each rider boarded is not tracked in this hot loop; it is
    recovered for the one rider that alights (:meth:`boarding`). Flat lists and list
    comprehensions keep 1,000 nodes x 80 layers within a few milliseconds.
    """

    def __init__(self, nodes: Sequence[_Node], arrivals: dict[int, _Arrival]) -> None:
        self.nodes, self.arrivals = nodes, arrivals
        self.cost: list[float] = []
        self.per_layer: list[float] = []
        self.latency: list[float] = []
        self.index: list[int] = []
        self.slot: dict[int, int] = {}
        self.retired = 0
        self.at = 0

    def advance(self, b: int) -> None:
        """Move every rider from the current boundary on to boundary ``b``."""
        steps, self.at = b - self.at, b
        if steps and self.cost:
            self.cost = [cost + steps * p for cost, p in zip(self.cost, self.per_layer)]

    def alight(self) -> _Arrival | None:
        """Best arrival at the current boundary by leaving one rider; None if none rides."""
        cheapest = min(self.cost, default=_UNBOARDED)
        if cheapest == _UNBOARDED:
            return None
        if self.cost.count(cheapest) == 1:
            tied = [self.cost.index(cheapest)]
        else:
            tied = [k for k, cost in enumerate(self.cost) if cost == cheapest]
        (rank, boarded_at), i = min((self.boarding(self.index[k]), self.index[k]) for k in tied)
        return _Arrival(cheapest, rank, i, boarded_at)

    def boarding(self, i: int) -> tuple[tuple, int]:
        """(tie-break rank, boundary) of the best place node ``i`` was boarded at."""
        node, b = self.nodes[i], self.at
        candidate, latency, per_layer = node.candidate, node.latency_ps, node.per_layer_ps
        best: tuple | None = None  # (cost, rank, boundary)
        for a, arrival in self.arrivals.items():
            if node.first <= a < b:
                cost = arrival.cost_ps + latency + (b - a) * per_layer
                if best is None or cost < best[0]:
                    best = (cost, _rank(arrival, candidate), a)
                elif cost == best[0] and (rank := _rank(arrival, candidate)) < best[1]:
                    best = (cost, rank, a)
        return best[1], best[2]

    def leave(self, ending: list[int]) -> None:
        """Retire the nodes in ``ending`` (their shard ends here); compact when half are gone."""
        for i in ending:
            k = self.slot[i]
            self.cost[k] = self.latency[k] = _UNBOARDED
        self.retired += len(ending)
        if 2 * self.retired > len(self.cost):
            keep = [k for k, lat in enumerate(self.latency) if lat != _UNBOARDED]
            columns = (self.cost, self.per_layer, self.latency, self.index)
            self.cost, self.per_layer, self.latency, self.index = ([c[k] for k in keep] for c in columns)
            self.slot = {i: k for k, i in enumerate(self.index)}
            self.retired = 0

    def join(self, joining: list[int]) -> None:
        """Add the nodes in ``joining`` (their shard starts here); the next :meth:`board` boards them."""
        self.slot.update((i, len(self.index) + n) for n, i in enumerate(joining))
        self.index += joining
        self.cost += [_UNBOARDED] * len(joining)
        self.per_layer += [self.nodes[i].per_layer_ps for i in joining]
        self.latency += [self.nodes[i].latency_ps for i in joining]

    def board(self, arrival: _Arrival) -> None:
        """Every rider may (re)start here after ``arrival`` when that is cheaper."""
        cost = arrival.cost_ps
        self.cost = list(map(min, self.cost, [cost + lat for lat in self.latency]))


def _undominated(num_layers: int, start_layer: int, candidates: Sequence[ShardCandidate],
                 load_penalty: float) -> list[_Node]:
    """Candidates that overlap the layers to route and that no other candidate dominates.

    ``j`` dominates ``i`` when ``j``'s span (clipped to the layers to route) contains
    ``i``'s and ``j`` is no slower per layer and no slower on the wire: any hop on ``i``
    can then run on ``j`` at no more cost. Candidates are scanned fastest first (ties:
    lower in_flight, then node id), so an equal twin loses to the one the tie-break
    prefers and the route found is unchanged. Typically 1,000 candidates leave a few
    dozen; the scan stops pruning past ``_MAX_FRONTIER`` survivors to bound its cost.
    """
    keyed = []
    for c in candidates:
        start, end = c.layers.start, c.layers.end
        if end > start_layer and start < num_layers:
            per_layer_ps = _to_ps(seconds_per_layer(c, load_penalty=load_penalty))
            node = _Node(per_layer_ps, _to_ps(c.latency_s), start if start > start_layer else start_layer,
                         end if end < num_layers else num_layers, c)
            keyed.append(((per_layer_ps, node.latency_ps, c.in_flight, c.node_id), node))
    keyed.sort(key=lambda item: item[0])
    frontier: list[tuple[int, int, float]] = []
    kept = []
    for _, node in keyed:
        if len(frontier) < _MAX_FRONTIER:
            first, last, latency = node.first, node.last, node.latency_ps
            if any(f <= first and last <= l and lat <= latency for f, l, lat in frontier):
                continue
            frontier.append((first, last, latency))
        kept.append(node)
    return kept


def _shortest_route(num_layers: int, start_layer: int, candidates: Sequence[ShardCandidate],
                    load_penalty: float) -> list[Hop]:
    """Sweep the boundaries left to right (the graph is a DAG): shortest path, ADR-0004."""
    nodes = _undominated(num_layers, start_layer, candidates, load_penalty)
    starting: dict[int, list[int]] = {}
    ending: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        starting.setdefault(node.first, []).append(i)
        ending.setdefault(node.last, []).append(i)
    arrivals: dict[int, _Arrival] = {}
    riders = _Riders(nodes, arrivals)
    for b in sorted({start_layer, num_layers, *starting, *ending}):
        riders.advance(b)
        arrival = _Arrival(0.0, (0, 0, ()), None, b) if b == start_layer else riders.alight()
        if arrival is None:
            break
        arrivals[b] = arrival
        if b == num_layers:
            return _hops(arrivals, num_layers, [node.candidate for node in nodes])
        riders.leave(ending.get(b, []))
        riders.join(starting.get(b, []))
        riders.board(arrival)
    raise NoRoute(max(arrivals), num_layers)


def _hops(arrivals: dict[int, _Arrival], num_layers: int,
          nodes: Sequence[ShardCandidate]) -> list[Hop]:
    """Walk the back-pointers from ``num_layers``; merge consecutive hops on one node."""
    hops: list[Hop] = []
    end = num_layers
    arrival = arrivals[end]
    while arrival.rider is not None:
        node = nodes[arrival.rider]
        start = arrival.boarded_at
        if hops and hops[-1].node_id == node.node_id:
            end = hops.pop().layers.end
        hops.append(Hop(node.node_id, node.endpoint, LayerRange(start, end)))
        end = start
        arrival = arrivals[start]
    hops.reverse()
    return hops
