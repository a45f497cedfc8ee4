"""Readiness and drain of the real apps in-process (ADR-0032).

Tracker: readiness shapes with concrete reasons, a node's own drain and deregistration, and
the chat proxy going around an entry node that is unreachable or draining, or that cuts a
stream. Node: readiness reasons, and while draining no new chats or hop sessions but the
sessions it holds go on. Entry nodes behind the tracker are httpx mock transports.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from meshnet.node import wire
from meshnet.layers import LayerRange
from meshnet.node.app import build_app as build_node
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from meshnet.tracker.app import build_app as build_tracker
from meshnet.tracker.service import TrackerSettings
from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, registration

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
SSE_DONE = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n'


def shard(start: int, end: int, *, entry: bool | None = None) -> dict:
    return {"model": MODEL, "shard_start": start, "shard_end": end, "entry": start == 0 if entry is None else entry,
            "tier": "pinned", "report": capability_report(MODEL, start, end)}


def node(node_id: str, *shards: dict) -> dict:
    return registration(node_id, f"http://{node_id}.test:8000", max_loaded_shards=2, shards=list(shards))


@pytest.fixture
def tracker_app():
    # these fake nodes compute nothing: admission challenges off (ADR-0042)
    return build_tracker(TrackerSettings(models=(MODEL,), db_path=":memory:", admission_challenges=False),
                         run_loop=False, transport=HealthyNodes())


@pytest.fixture
async def tracker(asgi_client, tracker_app):
    return await asgi_client(tracker_app, "http://tracker", auth=SignAsNodes())


async def register(client, *nodes: dict) -> None:
    for payload in nodes:
        resp = await client.post("/v1/nodes/register", json=payload)
        assert resp.status_code == 200, resp.text


class Body(httpx.AsyncByteStream):
    """A streamed body for mock entry responses (the proxy relays raw, unread streams)."""

    def __init__(self, data: bytes | dict) -> None:
        self.data = json.dumps(data).encode() if isinstance(data, dict) else data

    async def __aiter__(self):
        yield self.data


def answer(status: int, data: bytes | dict, ctype: str = "application/json") -> httpx.Response:
    return httpx.Response(status, stream=Body(data), headers={"content-type": ctype})


def entry_nodes(app, handler) -> httpx.AsyncClient:
    """Point the tracker's calls to nodes at ``handler(request) -> httpx.Response`` (raise to fail);
    reachability probes still find every node healthy."""
    app.state.http = httpx.AsyncClient(transport=HealthyNodes(httpx.MockTransport(handler)))
    return app.state.http


# ---- tracker readiness ------------------------------------------------------------------------


async def test_tracker_ready_names_the_coverage_gap_until_the_model_is_routable(tracker):
    resp = await tracker.get("/v1/ready")
    assert resp.status_code == 503
    assert resp.json() == {"ready": False, "models": [{"model": MODEL, "routable": False,
                                                       "gaps": [{"start_layer": 0, "end_layer": 3}]}],
                           "reasons": [f"{MODEL}: coverage gap at layers 0-3 (no admitted node serves them)"]}
    await register(tracker, node("a", shard(0, 1)))
    body = (await tracker.get("/v1/ready")).json()
    assert body["reasons"] == [f"{MODEL}: coverage gap at layers 2-3 (no admitted node serves them)"]
    await register(tracker, node("b", shard(2, 3)))
    resp = await tracker.get("/v1/ready")
    assert resp.status_code == 200
    assert resp.json() == {"ready": True, "reasons": [], "models": [{"model": MODEL, "routable": True, "gaps": []}]}


async def test_after_a_middle_node_drops_out_health_stays_ok_and_ready_names_its_layers(tracker, tracker_app):
    """Issue 9 §4, first input: SIGKILL of the middle node and 30 s later health said 200 ``ok``
    while chat got 503. Liveness stays 200; readiness now says 503 and which layers are gone."""
    await register(tracker, node("entry", shard(0, 0)), node("mid", shard(1, 2)), node("tail", shard(3, 3)))
    svc = tracker_app.state.service
    for n in ("entry", "tail"):  # they keep heartbeating; the middle one was SIGKILLed
        svc.nodes[n].last_heartbeat_s += 30.0
    assert svc.check_dropouts(now=time.monotonic() + 30.0) == ["mid"]
    health = await tracker.get("/v1/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ready = await tracker.get("/v1/ready")
    assert ready.status_code == 503
    assert ready.json()["reasons"] == [f"{MODEL}: coverage gap at layers 1-2 (no admitted node serves them)"]
    assert (await tracker.post("/v1/chat/completions", json=CHAT)).status_code == 503


async def test_tracker_ready_without_an_entry_node_says_so(tracker):
    await register(tracker, node("a", shard(0, 3, entry=False)))
    resp = await tracker.get("/v1/ready", params={"model": MODEL})
    assert resp.status_code == 503
    assert resp.json()["reasons"] == [f"{MODEL}: no admitted entry node (one serving layer 0 with the embeddings)"]


async def test_tracker_ready_for_an_unknown_model_is_404(tracker):
    resp = await tracker.get("/v1/ready", params={"model": "no-such-model"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


async def test_liveness_stays_200_while_not_ready(tracker):
    resp = await tracker.get("/v1/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"
    assert (await tracker.get("/v1/ready")).status_code == 503


async def test_a_draining_tracker_is_alive_not_ready_and_refuses_new_chats(tracker, tracker_app):
    await register(tracker, node("a", shard(0, 3)))
    tracker_app.state.drain.draining = True
    health = await tracker.get("/v1/health")
    assert health.status_code == 200 and health.json()["draining"] is True
    ready = await tracker.get("/v1/ready")
    assert ready.status_code == 503
    assert ready.json()["reasons"] == ["draining: the tracker is shutting down and takes no new chats"]
    chat = await tracker.post("/v1/chat/completions", json=CHAT)
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "draining"


# ---- a node's own drain and leave ----------------------------------------------------------------


async def test_a_draining_node_leaves_coverage_routes_and_entry_choice_at_once(tracker, tracker_app):
    await register(tracker, node("a", shard(0, 1)), node("b", shard(0, 1)), node("c", shard(2, 3)))
    resp = await tracker.post("/v1/nodes/a/drain")
    assert resp.status_code == 200 and resp.json() == {"node_id": "a", "draining": True}
    listed = {n["node_id"]: n for n in (await tracker.get("/v1/nodes")).json()["nodes"]}
    assert listed["a"]["draining"] is True and not listed["a"]["shards"][0]["admitted"]
    cov = (await tracker.get(f"/v1/coverage/{MODEL}")).json()
    assert cov["routable"] and cov["segments"][0]["node_count"] == 1
    for _ in range(5):
        hops = (await tracker.get("/v1/route", params={"model": MODEL})).json()["hops"]
        assert [h["node_id"] for h in hops] == ["b", "c"]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return answer(200, {"choices": []})

    async with entry_nodes(tracker_app, handler):
        for _ in range(3):
            assert (await tracker.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert seen == ["b.test"] * 3


async def test_a_heartbeat_does_not_undo_a_drain(tracker):
    await register(tracker, node("a", shard(0, 3)))
    await tracker.post("/v1/nodes/a/drain")
    resp = await tracker.post("/v1/nodes/a/heartbeat", json={"shards": [shard(0, 3)], "stats": {}})
    assert resp.status_code == 200
    assert (await tracker.get("/v1/nodes")).json()["nodes"][0]["draining"] is True
    assert (await tracker.get("/v1/ready")).status_code == 503


async def test_deregister_forgets_the_node_and_fails_its_open_directives(tracker):
    await register(tracker, node("a", shard(0, 3)))
    pinned = await tracker.post("/v1/operator/pin", json={"model": MODEL, "node_id": "a", "shard": "0-1"})
    assert pinned.status_code == 200
    resp = await tracker.delete("/v1/nodes/a")
    assert resp.status_code == 200 and resp.json() == {"node_id": "a", "deregistered": True}
    assert (await tracker.get("/v1/nodes")).json()["nodes"] == []
    assert not (await tracker.get(f"/v1/coverage/{MODEL}")).json()["routable"]
    directives = (await tracker.get("/v1/directives")).json()["directives"]
    assert directives and {(d["status"], d["error"]) for d in directives} == {("failed", "node deregistered")}
    assert (await tracker.delete("/v1/nodes/a")).status_code == 404
    assert (await tracker.post("/v1/nodes/a/drain")).status_code == 404


# ---- the chat proxy goes around entry nodes that are gone -------------------------------------------


async def test_an_unreachable_entry_is_skipped_for_this_chat_and_the_next(tracker, tracker_app):
    await register(tracker, node("a", shard(0, 3)), node("b", shard(0, 3)))
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "a.test":
            raise httpx.ConnectError("connection refused", request=request)
        return answer(200, SSE_DONE, "text/event-stream")

    async with entry_nodes(tracker_app, handler):
        first = await tracker.post("/v1/chat/completions", json={**CHAT, "stream": True})
        second = await tracker.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert first.status_code == 200 and first.text.endswith("data: [DONE]\n\n")
    assert second.status_code == 200
    assert seen == ["a.test", "b.test", "b.test"]  # a's failure makes it the last choice


async def test_an_entry_that_answers_draining_is_marked_and_skipped(tracker, tracker_app):
    await register(tracker, node("a", shard(0, 3)), node("b", shard(0, 3)))
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "a.test":
            return answer(503, {"error": {"message": "draining", "type": "x", "code": "draining"}})
        return answer(200, {"choices": []})

    async with entry_nodes(tracker_app, handler):
        assert (await tracker.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert seen == ["a.test", "b.test"]
    assert {n["node_id"]: n["draining"] for n in (await tracker.get("/v1/nodes")).json()["nodes"]} == \
        {"a": True, "b": False}


async def test_when_no_entry_answers_the_chat_is_502_entry_unreachable(tracker, tracker_app):
    await register(tracker, node("a", shard(0, 3)), node("b", shard(0, 3)))

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with entry_nodes(tracker_app, handler):
        resp = await tracker.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "entry_unreachable"


class CutStream(httpx.AsyncByteStream):
    """An entry's event stream that breaks after two events."""

    async def __aiter__(self):
        yield b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
        yield b'data: {"choices": [{"delta": {"content": "b"}}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


async def test_a_stream_cut_by_its_entry_ends_with_an_error_event(tracker, tracker_app):
    await register(tracker, node("a", shard(0, 3)))

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=CutStream(), headers={"content-type": "text/event-stream"})

    async with entry_nodes(tracker_app, handler):
        resp = await tracker.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 3 and "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "entry_unreachable"
    listed = (await tracker.get("/v1/nodes")).json()["nodes"]
    assert listed[0]["node_id"] == "a"  # reported (route cool-down), not dropped: it may be alive


# ---- node readiness and drain ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtimes(tiny_model_path):
    """``runtimes(start, end)``: a float32 runtime holding tiny-llama layers [start, end) (cached)."""
    built = {}

    def get(start: int, end: int) -> NodeRuntime:
        if (start, end) not in built:
            rt = NodeRuntime(max_loaded_shards=1, compute_dtype="float32")
            rt.load(MODEL, tiny_model_path(MODEL), LayerRange(start, end))
            built[start, end] = rt
        return built[start, end]

    return get


async def node_client(asgi_client, runtime: NodeRuntime, node_id: str):
    app = build_node(NodeSettings(node_id=node_id, port=8900, wire_dtype="float32"), runtime=runtime)
    return app, await asgi_client(app, f"http://{node_id}")


async def test_node_ready_waits_for_doctor_then_says_ready(asgi_client, runtimes):
    _, client = await node_client(asgi_client, runtimes(2, 4), "tail")
    resp = await client.get("/v1/ready")
    assert resp.status_code == 503
    assert resp.json() == {"ready": False, "node_id": "tail",
                           "reasons": [f"shard {MODEL} 2-3: capability check (doctor) not done yet"]}
    assert (await client.post("/v1/doctor")).status_code == 200
    resp = await client.get("/v1/ready")
    assert resp.status_code == 200 and resp.json() == {"ready": True, "node_id": "tail", "reasons": []}


async def test_a_standalone_entry_without_the_rest_of_the_model_is_not_ready(asgi_client, runtimes):
    _, client = await node_client(asgi_client, runtimes(0, 2), "half")
    await client.post("/v1/doctor")
    resp = await client.get("/v1/ready")
    assert resp.status_code == 503
    assert resp.json()["reasons"] == [f"{MODEL}: standalone entry holds layers 0-1 of 4 and has no tracker "
                                      "to route the rest"]


async def test_a_draining_node_keeps_its_sessions_but_takes_no_new_ones(asgi_client, runtimes):
    app, client = await node_client(asgi_client, runtimes(2, 4), "mid")
    session = uuid.uuid4().hex
    frame = wire.encode(__import__("torch").randn(1, 3, 64), dtype="float32")
    step = wire.encode(__import__("torch").randn(1, 1, 64), dtype="float32")

    def headers(sid: str, position: int) -> dict:
        return {"X-Meshnet-Session": sid, "X-Meshnet-Start-Layer": "2", "X-Meshnet-End-Layer": "3",
                "X-Meshnet-Position": str(position)}

    assert (await client.post("/v1/forward", content=frame, headers=headers(session, 0))).status_code == 200
    app.state.drain.draining = True
    held = await client.post("/v1/forward", content=step, headers=headers(session, 3))
    assert held.status_code == 200, held.text
    fresh = await client.post("/v1/forward", content=frame, headers=headers(uuid.uuid4().hex, 0))
    assert fresh.status_code == 503 and fresh.json()["error"]["code"] == "draining"
    assert fresh.headers["retry-after"] == "1"
    chat = await client.post("/v1/chat/completions", json=CHAT)
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "draining"
    health = await client.get("/v1/health")
    assert health.status_code == 200 and health.json()["draining"] is True
    ready = (await client.get("/v1/ready")).json()
    assert ready["reasons"][0] == "draining: the node is shutting down and takes no new sessions"
    await client.delete(f"/v1/sessions/{session}")
