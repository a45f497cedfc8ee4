"""The mesh's traffic behind one URL: ``GET /v1/traffic`` gathers every node's ``GET /v1/traffic``.

Fetched on demand, never on the heartbeat (ADR-0046): each registered node is asked at once,
each answer may take ``node_timeout_s``, and the gathered answer is kept ``cache_s`` seconds so
several consoles polling every 2 s cost the nodes one call per node per ``cache_s``. Callers
that arrive while a gathering runs share it. A node that cannot be read (refused, timed out,
a bad answer) is listed with its ``error`` and empty lists; it never fails the whole answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import httpx
from pydantic import ValidationError

from meshnet.protocol.traffic import MeshTraffic, NodeTraffic

#: seconds a gathered answer is served again
CACHE_S = 1.5
#: seconds one node has to answer
NODE_TIMEOUT_S = 2.0
#: failover events in the mesh-wide list (newest win)
MAX_FAILOVERS = 200


#: ``(method, path) -> headers`` that sign a call as the tracker (ADR-0049)
Signer = Callable[[str, str], dict[str, str]]


async def fetch_node_traffic(http: httpx.AsyncClient, node_id: str, endpoint: str, timeout_s: float,
                             now_s: float, sign: Signer | None = None) -> NodeTraffic:
    """``GET {endpoint}/v1/traffic`` of one node, within ``timeout_s`` seconds, signed with ``sign``
    when given (a node shows session ids only to its tracker; others get aliases).

    Returns the node's answer, or a :class:`NodeTraffic` naming the ``error`` (never raises for a
    network or protocol error). An answer that names another node is an error too.
    """
    url = f"{endpoint}/v1/traffic"
    try:
        headers = sign("GET", httpx.URL(url).path) if sign is not None else None
        async with asyncio.timeout(timeout_s):  # in-process transports ignore httpx's own timeout
            resp = await http.get(url, timeout=timeout_s, headers=headers)
        if resp.status_code != 200:
            raise ValueError(f"answered HTTP {resp.status_code}")
        body = NodeTraffic.model_validate_json(resp.content)
    except Exception as exc:  # noqa: BLE001 - refused, slow, old node, bad body
        why = "timed out" if isinstance(exc, TimeoutError) else \
            ("sent an invalid body" if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}")
        return NodeTraffic(node_id=node_id, at_s=now_s, error=f"GET {url} {why}"[:300])
    if body.node_id != node_id:
        return NodeTraffic(node_id=node_id, at_s=now_s, error=f"GET {url} answered as node {body.node_id!r}")
    return body


def merge_traffic(nodes: list[NodeTraffic], now_s: float) -> MeshTraffic:
    """One mesh-wide answer: nodes by id, sessions oldest first, failovers newest first (at most
    :data:`MAX_FAILOVERS`; an event reported twice is listed once). The sessions and failovers move
    from the nodes' entries to the mesh-wide lists (each is said once)."""
    nodes = sorted(nodes, key=lambda n: n.node_id)
    sessions = sorted((s for n in nodes for s in n.sessions), key=lambda s: (-s.age_s, s.session_id))
    seen, failovers = set(), []
    for event in sorted((e for n in nodes for e in n.failovers), key=lambda e: -e.at_s):
        key = (event.session_id, event.failed_node, event.at_s)
        if key not in seen:
            seen.add(key)
            failovers.append(event)
    return MeshTraffic(at_s=now_s, nodes=[n.model_copy(update={"sessions": [], "failovers": []}) for n in nodes],
                       sessions=sessions, failovers=failovers[:MAX_FAILOVERS])


def last_buckets(traffic: MeshTraffic, count: int) -> MeshTraffic:
    """``traffic`` with each node's history cut to its last ``count`` buckets (``count >= 1``)."""
    return traffic.model_copy(update={"nodes": [n.model_copy(update={"buckets": n.buckets[-count:]})
                                                for n in traffic.nodes]})


class TrafficGatherer:
    """Gathers and caches the mesh's traffic.

    Args:
        http: ``() ->`` the tracker's outbound client (read at each gathering).
        endpoints: ``() -> [(node_id, endpoint)]`` of the registered nodes now.
        cache_s: seconds an answer is served again; ``node_timeout_s``: per node.
        sign: signs each node's call as the tracker (None: unsigned; nodes then show aliases).
        clock: wall-clock seconds (for ``at_s``); the cache runs on ``time.monotonic``.
    """

    def __init__(self, http: Callable[[], httpx.AsyncClient], endpoints: Callable[[], list[tuple[str, str]]], *,
                 cache_s: float = CACHE_S, node_timeout_s: float = NODE_TIMEOUT_S,
                 clock: Callable[[], float] = time.time, sign: Signer | None = None) -> None:
        self.http, self.endpoints, self.sign = http, endpoints, sign
        self.cache_s, self.node_timeout_s = cache_s, node_timeout_s
        self.clock = clock
        self._cached: tuple[float, MeshTraffic] | None = None
        self._running: asyncio.Task | None = None

    async def traffic(self) -> MeshTraffic:
        """The mesh's traffic, at most ``cache_s`` old."""
        if self._cached is not None and time.monotonic() - self._cached[0] < self.cache_s:
            return self._cached[1]
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._gather())
        return await asyncio.shield(self._running)

    async def _gather(self) -> MeshTraffic:
        now = self.clock()
        http = self.http()
        answers = await asyncio.gather(*(fetch_node_traffic(http, node_id, endpoint, self.node_timeout_s, now, self.sign)
                                         for node_id, endpoint in self.endpoints()))
        merged = merge_traffic(list(answers), now)
        self._cached = (time.monotonic(), merged)
        return merged
