"""Console test harness: a real in-process tracker, fake node registrations, a real doctor node.

- ``tracker`` (async fixture): the tracker app (``run_loop=False``) with its lifespan running,
  reached through ``httpx.ASGITransport``; ``tracker.console(...)`` builds a console wired
  to it through a :class:`TrackerClient`.
- :class:`LazyTrackerTransport`: for the snapshot tests, which must be synchronous
  (``snap_compare`` runs the app in its own event loop): the tracker's lifespan starts
  on the first request, inside the console's loop, and stops when the console closes
  its client.
- ``doctor_node``: a real uvicorn server on a free 127.0.0.1 port, in a thread, serving a
  minimal node API (``POST /v1/doctor``); the tracker calls it over the network.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from asgi_lifespan import LifespanManager
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from meshnet.client import TrackerClient
from meshnet.protocol.control import HeartbeatRequest, RegisterRequest
from meshnet.tracker.app import build_app
from meshnet.tracker.service import TrackerSettings
from tests.payloads import SignAsNodes, capability_report, registration
from tests.fake_nodes import HealthyNodes
from tui.app import MeshnetConsole

MODEL = "tiny-llama"
TRACKER_URL = "http://tracker.test"
SIZE = (120, 36)
GiB = 1024**3


def shard(start: int, end: int, *, model: str = MODEL, tier: str = "bootstrap", passed: bool = True,
          timestamp: float | None = None, tokens_per_s: float = 50.0, weight_bytes: int = 115_200) -> dict:
    """One shard of a register/heartbeat payload with its capability report (inclusive range)."""
    return {"model": model, "shard_start": start, "shard_end": end, "tier": tier, "entry": start == 0,
            "quantization": "bfloat16", "weight_bytes": weight_bytes,
            "report": capability_report(model, start, end, passed=passed, timestamp=timestamp,
                                        tokens_per_s=tokens_per_s)}


def node_payload(node_id: str, endpoint: str, shards: list[dict], *, vram_bytes: int = 2 * GiB,
                 max_loaded_shards: int = 2) -> RegisterRequest:
    return RegisterRequest.model_validate(registration(node_id, endpoint, vram_bytes=vram_bytes, device="cpu",
                                                       max_loaded_shards=max_loaded_shards, shards=shards))


def heartbeat_payload(shards: list[dict], stats: dict | None = None) -> HeartbeatRequest:
    return HeartbeatRequest.model_validate({"shards": shards, "stats": stats or {}})


class FakeClock:
    """A console clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SwitchableTransport(httpx.AsyncBaseTransport):
    """Wraps a transport; while ``down`` every request fails like a closed port."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.down = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class LazyTrackerTransport(httpx.AsyncBaseTransport):
    """ASGI transport to a tracker app whose lifespan starts with the first request."""

    def __init__(self, app) -> None:
        self.app = app
        self._manager: LifespanManager | None = None
        self._inner: httpx.ASGITransport | None = None
        self._lock: asyncio.Lock | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._inner is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._inner is None:
                    self._manager = LifespanManager(self.app)
                    await self._manager.__aenter__()
                    self._inner = httpx.ASGITransport(app=self._manager.app)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        if self._manager is not None:
            manager, self._manager, self._inner = self._manager, None, None
            await manager.__aexit__(None, None, None)


class FakeTraffic(httpx.AsyncBaseTransport):
    """The fake nodes' ``GET /v1/traffic``: ``answers[host]`` (a NodeTraffic JSON body), a
    refused connection for a host without one; ``calls`` counts the calls. Anything else goes
    to ``inner``."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.answers: dict[str, dict] = {}
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/traffic":
            self.calls += 1
            answer = self.answers.get(request.url.host)
            if answer is None:
                raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
            return httpx.Response(200, json=answer)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def buckets(values: list[tuple], end_s: float = 1_000_000.0) -> list[dict]:
    """Traffic buckets ending at ``end_s`` from ``(ttft_s, tpot_s, forward_tokens, batch_size)`` rows
    (oldest first; one first token and one finish where the mean is not None, two forwards each)."""
    first = end_s - 10.0 * (len(values) - 1)
    return [{"start_s": first + 10.0 * i, "ttft_s": ttft, "first_tokens": int(ttft is not None), "tpot_s": tpot,
             "finished": int(tpot is not None), "forward_tokens": tokens, "batch_size": batch,
             "batch_size_max": round(batch), "forwards": 2}
            for i, (ttft, tpot, tokens, batch) in enumerate(values)]


def session(session_id: str, entry: str, route: list[tuple[str, int, int]], *, age_s: float = 3.0,
            ttft_s: float | None = 0.25, tokens: tuple[int, int] = (40, 7), failovers: int = 0) -> dict:
    return {"session_id": session_id, "model": MODEL, "entry_node": entry,
            "route": [{"node_id": n, "start_layer": a, "end_layer": b} for n, a, b in route],
            "prompt_tokens": tokens[0], "completion_tokens": tokens[1], "age_s": age_s, "ttft_s": ttft_s,
            "failovers": failovers}


def failover(session_id: str, entry: str, failed: str, replacement: list[str], at_s: float,
             layers: tuple[int, int] = (2, 3), reason: str = "missed its deadline (frozen)") -> dict:
    return {"at_s": at_s, "session_id": session_id, "entry_node": entry, "failed_node": failed,
            "start_layer": layers[0], "end_layer": layers[1], "replacement": replacement, "reason": reason}


def node_traffic(node_id: str, *, rows=(), sessions=(), failovers=(), kv_sessions: int | None = None) -> dict:
    """A node's ``GET /v1/traffic`` body (``kv_sessions`` defaults to its entry sessions)."""
    return {"node_id": node_id, "at_s": 1_000_000.0, "bucket_s": 10.0, "buckets": buckets(list(rows)),
            "sessions": list(sessions), "failovers": list(failovers), "error": None,
            "kv_sessions": len(sessions) if kv_sessions is None else kv_sessions}


def tracker_app(traffic: FakeTraffic | None = None):
    """A tracker whose probes find every fake node reachable (tests.fake_nodes); its traffic
    calls to them go to ``traffic`` (default: none answers). The traffic cache is off, so
    every console poll sees the fake nodes' current answers."""
    app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:"), run_loop=False,
                    transport=HealthyNodes(traffic or FakeTraffic()))
    app.state.traffic.cache_s = 0.0
    return app


@dataclass
class TrackerHarness:
    """A running in-process tracker and a client of it (for seeding and for checks)."""

    app: object
    transport: httpx.AsyncBaseTransport
    traffic: FakeTraffic = field(default_factory=FakeTraffic)  # the fake nodes' GET /v1/traffic
    client: TrackerClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = TrackerClient(TRACKER_URL, transport=self.transport, auth=SignAsNodes())  # fake nodes sign

    @property
    def service(self):
        return self.app.state.service

    async def register(self, node_id: str, shards: list[dict], endpoint: str | None = None, **kw):
        return await self.client.register(node_payload(node_id, endpoint or f"http://{node_id}.test:8701",
                                                       shards, **kw))

    async def heartbeat(self, node_id: str, shards: list[dict], stats: dict | None = None) -> list:
        return (await self.client.heartbeat(node_id, heartbeat_payload(shards, stats))).directives

    def console(self, *, transport: httpx.AsyncBaseTransport | None = None, **kw) -> MeshnetConsole:
        kw.setdefault("interval_s", 60.0)  # tests poll explicitly (refresh_now)
        client = TrackerClient(TRACKER_URL, transport=transport or self.transport)
        return MeshnetConsole(url=TRACKER_URL, client=client, **kw)


@pytest.fixture
async def tracker():
    traffic = FakeTraffic()
    app = tracker_app(traffic)
    async with LifespanManager(app) as manager:
        harness = TrackerHarness(app, httpx.ASGITransport(app=manager.app), traffic)
        yield harness
        await harness.client.aclose()


# ---- a real node endpoint for doctor -------------------------------------------------------


@dataclass
class DoctorNode:
    """A minimal node API on a real socket: ``POST /v1/doctor`` answers with passed reports."""

    shards: list[tuple[str, int, int]]
    calls: list[float] = field(default_factory=list)
    url: str = ""

    def app(self) -> Starlette:
        async def doctor(request: Request) -> JSONResponse:
            self.calls.append(time.time())
            reports = [{"model": m, "shard_start": a, "shard_end": b, "passed": True, "tokens_per_s": 123.4,
                        "reason": "forward pass finite and well-shaped", "timestamp": time.time(),
                        "recipe": {"quantization": "bfloat16", "compute_dtype": "float32"},
                        "hardware": {"device": "cpu", "cpu_count": 4, "ram_bytes": 8 * GiB}}
                       for m, a, b in self.shards]
            return JSONResponse({"reports": reports})

        return Starlette(routes=[Route("/v1/doctor", doctor, methods=["POST"])])


@pytest.fixture
def doctor_node():
    node = DoctorNode(shards=[(MODEL, 0, 3)])
    server = uvicorn.Server(uvicorn.Config(node.app(), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("doctor node server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    node.url = f"http://127.0.0.1:{port}"
    try:
        yield node
    finally:
        server.should_exit = True
        thread.join(timeout=10)

