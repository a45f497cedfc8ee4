"""The tracker admits a node's shards only once it has reached the node's endpoint.

In-process tracker app; its outbound calls go through :class:`tests.fake_nodes.HealthyNodes`
(fake nodes answer the probe unless their host is ``down``), or through the real network
to a 127.0.0.1 port nobody listens on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import pytest

from meshnet.tracker.app import build_app
from meshnet.tracker.service import TrackerSettings
from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, registration, route_ticket, signed

MODEL = "tiny-llama"


def node(node_id: str, endpoint: str | None = None, last_layer: int = 3) -> dict:
    report = capability_report(MODEL, 0, last_layer)
    return registration(node_id, endpoint or f"http://{node_id}.test:8000", vram_bytes=2 * 1024**3,
                        shards=[{"model": MODEL, "shard_start": 0, "shard_end": last_layer, "entry": True,
                                 "report": report}])


@pytest.fixture
def make_tracker(asgi_client):
    """``make(transport=None, run_loop=False, **settings) -> (app, client)``; None: the real network."""
    async def make(transport=None, run_loop: bool = False, **settings):
        settings.setdefault("admission_challenges", False)  # these fake nodes compute nothing
        app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:", **settings), run_loop=run_loop,
                        transport=transport)
        return app, await asgi_client(app, "http://tracker", auth=SignAsNodes())
    return make


async def routable(client) -> bool:
    return (await client.get(f"/v1/coverage/{MODEL}")).json()["routable"]


async def view(client) -> dict:
    (one,) = (await client.get("/v1/nodes")).json()["nodes"]
    return one


async def wait_for(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def test_a_node_nobody_can_connect_to_is_registered_but_not_admitted(make_tracker):
    with socket.socket() as s:  # a port nothing listens on, on the real network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, tracker = await make_tracker()
    t0 = time.monotonic()
    resp = await tracker.post("/v1/nodes/register", json=node("n1", f"http://127.0.0.1:{port}"))
    assert resp.status_code == 200 and time.monotonic() - t0 < 5
    body = resp.json()
    assert body["reachable"] is False and "ConnectError" in body["reach_error"]
    assert f"GET http://127.0.0.1:{port}/v1/health failed" in body["reach_error"]
    one = await view(tracker)
    assert one["reachable"] is False and "ConnectError" in one["reach_error"]
    assert [s["admitted"] for s in one["shards"]] == [False]
    assert not await routable(tracker)
    resp = await tracker.get("/v1/route", params={"model": MODEL})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_loading"


async def test_a_reachable_node_is_admitted_at_registration(make_tracker):
    nodes = HealthyNodes()
    _, tracker = await make_tracker(nodes)
    body = (await tracker.post("/v1/nodes/register", json=node("n1"))).json()
    assert body["reachable"] is True and body["reach_error"] == ""
    assert nodes.probes == ["http://n1.test:8000/v1/health"]
    assert await routable(tracker)


async def test_an_endpoint_answering_as_another_node_is_not_admitted(make_tracker):
    def other(request):  # the advertised endpoint is someone else's node
        return httpx.Response(200, json={"status": "ok", "node_id": "n-else"})

    _, tracker = await make_tracker(httpx.MockTransport(other))
    body = (await tracker.post("/v1/nodes/register", json=node("n1"))).json()
    assert body["reachable"] is False and "answered as node 'n-else', not 'n1'" in body["reach_error"]
    assert not await routable(tracker)


async def test_an_unreachable_node_is_admitted_once_it_answers(make_tracker):
    nodes = HealthyNodes()
    nodes.down.add("n1.test")  # e.g. it registers before it listens
    _, tracker = await make_tracker(nodes, run_loop=True, probe_interval_s=0.1)
    assert (await tracker.post("/v1/nodes/register", json=node("n1"))).json()["reachable"] is False
    assert not await routable(tracker)
    nodes.down.clear()
    await wait_for(lambda: routable(tracker))
    assert (await view(tracker))["reachable"] is True
    resp = await tracker.post("/v1/nodes/n1/heartbeat", json={"shards": node("n1")["shards"]})
    assert resp.json()["reachable"] is True


async def test_a_failure_report_probes_again_and_an_unreachable_node_leaves_the_routes(make_tracker):
    nodes = HealthyNodes()
    _, tracker = await make_tracker(nodes)
    await tracker.post("/v1/nodes/register", json=node("n1"))
    await tracker.post("/v1/nodes/register", json=node("n0", last_layer=0))  # an entry that routes through n1
    assert await routable(tracker)
    nodes.down.add("n1.test")
    ticket = await route_ticket(tracker, "n0", MODEL, 1, 3, "s1")  # n1 on n0's route
    body = json.dumps({"reason": "hop timed out", "ticket": ticket}).encode()
    resp = await tracker.post("/v1/nodes/n1/failure", content=body,
                              headers=signed("n0", "POST", "/v1/nodes/n1/failure", body))
    assert resp.status_code == 200
    await wait_for(lambda: _unreachable(tracker))  # no control loop here: the report itself probed
    assert not await routable(tracker)
    resp = await tracker.post("/v1/nodes/n1/heartbeat", json={"shards": node("n1")["shards"]})
    assert resp.json()["reachable"] is False and "Connection refused" in resp.json()["reach_error"]


async def _unreachable(tracker, node_id: str = "n1") -> bool:
    views = {n["node_id"]: n for n in (await tracker.get("/v1/nodes")).json()["nodes"]}
    return not views[node_id]["reachable"]


def streamed(status: int, body: dict) -> httpx.Response:
    """A JSON answer as a not-yet-read stream (what a real node sends; the tracker streams it through)."""
    return httpx.Response(status, headers={"content-type": "application/json"},
                          stream=httpx.ByteStream(json.dumps(body).encode()))


FULL = {"error": {"message": "session cache full", "type": "service_unavailable", "code": "session_cache_full"}}


async def test_a_chat_goes_to_the_next_entry_node_when_the_first_has_no_session_room(make_tracker):
    calls = []

    def entries(request):
        if request.url.path == "/v1/health":
            return httpx.Response(200, json={"status": "ok"})
        calls.append(request.url.host)
        if request.url.host == "a.test":
            return streamed(503, FULL)
        return streamed(200, {"object": "chat.completion", "served_by": request.url.host})

    _, tracker = await make_tracker(httpx.MockTransport(entries))
    for name in ("a", "b"):
        await tracker.post("/v1/nodes/register", json=node(name))
    resp = await tracker.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
    assert resp.status_code == 200 and resp.json()["served_by"] == "b.test"
    assert calls == ["a.test", "b.test"]


async def test_when_every_entry_node_is_full_the_client_gets_the_503(make_tracker):
    def full(request):
        if request.url.path == "/v1/health":
            return httpx.Response(200, json={"status": "ok"})
        return streamed(503, FULL)

    _, tracker = await make_tracker(httpx.MockTransport(full))
    for name in ("a", "b"):
        await tracker.post("/v1/nodes/register", json=node(name))
    resp = await tracker.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "session_cache_full"


async def test_a_failed_heartbeat_round_does_not_stop_the_node_agent():
    """E.g. a heartbeat answered 404 re-registers, and the tracker is gone again: the error
    used to escape ``run`` and end the heartbeats for good (the node then dropped out)."""
    from meshnet.errors import MeshnetError
    from meshnet.node.agent import TrackerAgent

    from meshnet.relay.backoff import Backoff

    agent = TrackerAgent.__new__(TrackerAgent)
    agent.interval_s, agent.wake = 0.01, asyncio.Event()
    agent.failures, agent.backoff = 0, Backoff(0.01, 0.01)
    rounds = []

    async def heartbeat():
        rounds.append(1)
        if len(rounds) == 1:
            raise MeshnetError("register node: cannot reach the tracker", status=503)

    agent.heartbeat = heartbeat
    task = asyncio.create_task(agent.run())
    await wait_for(lambda: asyncio.sleep(0, len(rounds) >= 3))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert len(rounds) >= 3


async def test_an_unexpected_error_in_a_tracker_handler_is_a_json_500(asgi_client, monkeypatch):
    from meshnet.tracker import views

    app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:"), run_loop=False, transport=HealthyNodes())
    tracker = await asgi_client(app, "http://tracker", raise_app_exceptions=False)
    monkeypatch.setattr(views, "nodes_view", lambda svc: 1 / 0)
    resp = await tracker.get("/v1/nodes")
    assert resp.status_code == 500 and resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "internal_error" and "ZeroDivisionError" in resp.json()["error"]["message"]
