"""The tracker serving the first layers (ADR-0044): the composed app in-process, tiny-llama weights.

The tracker's own node (``tracker``, layers 0-1, mounted at ``/node``) and a separate node app
(``n2``, layers 2-3) reach each other and the tracker through one host-routing ASGI transport,
so nothing listens on a port. The two apps keep their clashing routes apart, the tracker's node
registers, is probed and admitted like any node, and a chat at the tracker is answered by its
own node in-process: the route's first hop is the tracker, and no chat request crosses the
transport.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from asgi_lifespan import LifespanManager
from starlette.responses import JSONResponse

from meshnet.layers import LayerRange
from meshnet.node.app import build_app as build_node
from meshnet.node.settings import NodeSettings
from meshnet.tracker.proxy import LocalChat, LocalNode
from meshnet.tracker.service import TrackerSettings
from meshnet.trackernode import NODE_PREFIX, build_app, local_tracker_url, node_endpoint

MODEL = "tiny-llama"
TRACKER = "http://tracker.test"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello mesh"}], "max_tokens": 6,
        "temperature": 0}


class Hosts(httpx.AsyncBaseTransport):
    """Sends each request to the ASGI app of its host; records every (method, host, path)."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}
        self.sent: list[tuple[str, str, str]] = []

    def add(self, host: str, app) -> None:
        self.apps[host] = httpx.ASGITransport(app=app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.method, request.url.host, request.url.path))
        app = self.apps.get(request.url.host)
        if app is None:
            raise httpx.ConnectError(f"no app at {request.url.host}", request=request)
        return await app.handle_async_request(request)


@contextlib.asynccontextmanager
async def composed_mesh(tmp_path, own_layers: LayerRange, other: str, other_layers: LayerRange):
    """(client of the composed app, the transport, the composed app) with ``MODEL`` routable: the
    tracker's own node serves ``own_layers``, node ``other`` at ``http://<other>.test`` the rest."""
    hosts = Hosts()
    common = dict(model=MODEL, compute_dtype="float32", wire_dtype="float32", heartbeat_interval_s=0.2,
                  tracker_url=TRACKER)
    own = NodeSettings(node_id="tracker", public_url=node_endpoint(TRACKER), shard=own_layers,
                       state_dir=tmp_path / "tracker", **common)
    composed = build_app(TrackerSettings(models=(MODEL,), heartbeat_interval_s=0.2, join_settle_s=0.0), own,
                         transport=hosts)
    node = build_node(NodeSettings(node_id=other, public_url=f"http://{other}.test", shard=other_layers,
                                   state_dir=tmp_path / other, **common), transport=hosts)
    hosts.add("tracker.test", composed)
    hosts.add(f"{other}.test", node)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(LifespanManager(composed, startup_timeout=60, shutdown_timeout=30))
        await stack.enter_async_context(LifespanManager(node, startup_timeout=60, shutdown_timeout=30))
        client = await stack.enter_async_context(httpx.AsyncClient(transport=hosts, base_url=TRACKER))
        for _ in range(300):  # bounded: 30 s for both nodes to load, register, be probed and admitted
            cov = (await client.get(f"/v1/coverage/{MODEL}")).json()
            if cov.get("routable"):
                break
            await asyncio.sleep(0.1)
        assert cov["routable"], cov
        yield client, hosts, composed


@pytest.fixture
async def mesh(tiny_model_path, tmp_path, monkeypatch):
    """The tracker serves layers 0-1 (the entry), node ``n2`` layers 2-3."""
    monkeypatch.setenv("MESHNET_CACHE", str(tiny_model_path(MODEL).parent.parent))
    async with composed_mesh(tmp_path, LayerRange(0, 2), "n2", LayerRange(2, 4)) as parts:
        yield parts


async def test_clashing_routes_stay_apart(mesh):
    client, _, _ = mesh
    tracker, node = (await client.get("/v1/health")).json(), (await client.get("/node/v1/health")).json()
    assert tracker["status"] == "ok" and tracker["nodes"] == 2 and tracker["models"] == [MODEL]
    assert tracker["local_node"] == {"node_id": "tracker", "error": None}
    assert node["node_id"] == "tracker" and node["endpoint"] == "http://tracker.test/node"
    assert [(s["model"], s["shard_start"], s["shard_end"]) for s in node["shards"]] == [(MODEL, 0, 1)]
    assert (await client.get("/v1/ready")).status_code == 200
    ready = await client.get("/node/v1/ready")
    assert ready.status_code == 200 and ready.json()["node_id"] == "tracker"
    assert "meshnet_tracker_" in (await client.get("/metrics")).text
    assert "meshnet_tracker_" not in (await client.get("/node/metrics")).text
    assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL]
    assert [m["id"] for m in (await client.get("/node/v1/models")).json()["data"]] == [MODEL]


async def test_the_tracker_node_is_registered_and_shown_like_any_node(mesh):
    client, hosts, _ = mesh
    nodes = {n["node_id"]: n for n in (await client.get("/v1/nodes")).json()["nodes"]}
    assert sorted(nodes) == ["n2", "tracker"]
    own = nodes["tracker"]
    assert own["endpoint"] == "http://tracker.test/node" and own["reachable"] is True
    assert [(s["shard_start"], s["shard_end"], s["entry"]) for s in own["shards"]] == [(0, 1, True)]
    # it registered over HTTP with a signature, and the tracker probed it at its /node endpoint
    assert ("POST", "tracker.test", "/v1/nodes/register") in hosts.sent
    assert ("GET", "tracker.test", "/node/v1/health") in hosts.sent
    segments = (await client.get(f"/v1/coverage/{MODEL}")).json()["segments"]
    assert [(s["start_layer"], s["end_layer"], s["node_count"]) for s in segments] == [(0, 3, 1)]


async def direct_then_via_tracker(client, hosts, path: str, body: dict) -> tuple[dict, dict]:
    """The answers to ``body`` from the tracker's own node (``/node{path}``) and then from the
    tracker (``path``), the hosts' record cleared in between; both must be 200."""
    direct = await client.post(f"/node{path}", json=body)
    assert direct.status_code == 200, direct.text
    hosts.sent.clear()
    resp = await client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return direct.json(), resp.json()


async def test_chat_at_the_tracker_is_answered_in_process_by_its_own_node(mesh):
    client, hosts, _ = mesh
    direct, data = await direct_then_via_tracker(client, hosts, "/v1/chat/completions", CHAT)
    route = [(h["node_id"], h["endpoint"], h["start_layer"], h["end_layer"]) for h in data["meshnet"]["route"]]
    assert route == [("tracker", "http://tracker.test/node", 0, 1), ("n2", "http://n2.test", 2, 3)]
    assert data["meshnet"]["completion_token_ids"] == direct["meshnet"]["completion_token_ids"]
    assert len(data["meshnet"]["completion_token_ids"]) == 6
    chats = [s for s in hosts.sent if s[2].endswith("/chat/completions")]
    assert chats == [("POST", "tracker.test", "/v1/chat/completions")]  # the test's own call, no proxy hop
    assert ("POST", "n2.test", "/v1/forward") in hosts.sent


async def test_a_text_completion_at_the_tracker_is_answered_by_its_own_node_across_the_mesh(mesh):
    client, hosts, _ = mesh
    body = {"model": MODEL, "prompt": [40, 41, 42], "max_tokens": 5, "temperature": 0}
    direct, data = await direct_then_via_tracker(client, hosts, "/v1/completions", body)
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == direct["choices"][0]["text"]
    route = [(h["node_id"], h["start_layer"], h["end_layer"]) for h in data["meshnet"]["route"]]
    assert route == [("tracker", 0, 1), ("n2", 2, 3)]
    assert [s for s in hosts.sent if s[2].endswith("/completions")] == [("POST", "tracker.test", "/v1/completions")]


async def test_a_tracker_serving_later_layers_proxies_to_the_entry_and_serves_as_a_hop(tiny_model_path, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("MESHNET_CACHE", str(tiny_model_path(MODEL).parent.parent))
    async with composed_mesh(tmp_path, LayerRange(2, 4), "n0", LayerRange(0, 2)) as (client, hosts, _):
        hosts.sent.clear()
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200, resp.text
        route = [(h["node_id"], h["start_layer"], h["end_layer"]) for h in resp.json()["meshnet"]["route"]]
        assert route == [("n0", 0, 1), ("tracker", 2, 3)]
        assert ("POST", "n0.test", "/v1/chat/completions") in hosts.sent  # proxied: the entry is elsewhere
        assert ("POST", "tracker.test", "/node/v1/forward") in hosts.sent  # the tracker's node as the last hop
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["object"] == "text_completion", resp.text
        assert ("POST", "n0.test", "/v1/completions") in hosts.sent  # proxied like a chat


async def test_a_streamed_chat_at_the_tracker_ends_with_done(mesh):
    client, _, _ = mesh
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"route"' in events[-2]


async def test_operator_actions_reach_the_tracker_node(mesh):
    client, hosts, _ = mesh
    doctor = await client.post("/v1/operator/doctor", json={"node_id": "tracker"})
    assert doctor.status_code == 200, doctor.text
    (report,) = doctor.json()["reports"]
    assert (report["shard_start"], report["shard_end"], report["passed"]) == (0, 1, True)
    assert ("POST", "tracker.test", "/node/v1/doctor") in hosts.sent
    reload = (await client.post("/v1/operator/reload", json={"node_id": "tracker"})).json()["directive"]
    for _ in range(200):  # bounded: delivered with a heartbeat (0.2 s), applied, reported done
        done = [d for d in (await client.get("/v1/directives", params={"node_id": "tracker"})).json()["directives"]
                if d["id"] == reload["id"] and d["status"] in ("done", "failed")]
        if done:
            break
        await asyncio.sleep(0.1)
    assert [(d["type"], d["status"]) for d in done] == [("RELOAD", "done")]
    drained = await client.post("/v1/operator/drain", json={"node_id": "tracker"})
    assert drained.json() == {"node_id": "tracker", "draining": True}
    resp = await client.post("/v1/chat/completions", json=CHAT)  # its only entry drained: a gap at layer 0
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_loading"


async def test_sigterm_drains_the_node_and_the_tracker_together(mesh):
    client, _, composed = mesh
    assert await composed.state.drain.run() is True
    assert composed.state.tracker_app.state.drain.draining and composed.state.node_app.state.drain.draining
    assert (await client.get("/v1/nodes")).json()["nodes"][0]["node_id"] == "n2"  # deregistered itself
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "draining"


# ---- LocalChat without models: what reaches the client ---------------------------------------


def answering(status: int, body: dict):
    async def app(scope, receive, send):
        message = await receive()
        assert message["body"] == b'{"q": 1}' and scope["path"] == "/v1/chat/completions"
        await JSONResponse(body, status_code=status)(scope, receive, send)
    return app


async def call(response) -> httpx.Response:
    async def app(scope, receive, send):
        await receive()
        await response(scope, receive, send)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/v1/chat/completions", content=b'{"q": 1}')


@pytest.mark.parametrize("status, code, expected", [
    (200, None, (200, "local")),
    (503, "session_cache_full", (200, "remote")),
    (503, "draining", (200, "remote")),
    (503, "model_loading", (503, "model_loading")),
    (400, "invalid_field", (400, "invalid_field")),
])
async def test_local_chat_hands_a_refused_chat_to_the_remote_entries(status, code, expected):
    body = {"answer": "local"} if code is None else {"error": {"message": "x", "type": "t", "code": code}}

    async def remote():
        return JSONResponse({"answer": "remote"})

    resp = await call(LocalChat(LocalNode("tracker", answering(status, body)), b'{"q": 1}', fallback=remote))
    got = resp.json().get("answer") or resp.json()["error"]["code"]
    assert (resp.status_code, got) == expected


async def test_local_chat_without_remote_entries_passes_the_refusal_on():
    body = {"error": {"message": "full", "type": "t", "code": "session_cache_full"}}
    resp = await call(LocalChat(LocalNode("tracker", answering(503, body)), b'{"q": 1}'))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "session_cache_full"


@pytest.mark.parametrize("host, port, url", [
    ("127.0.0.1", 8700, "http://127.0.0.1:8700"), ("0.0.0.0", 8700, "http://127.0.0.1:8700"),
    ("::", 9000, "http://[::1]:9000"), ("::1", 9000, "http://[::1]:9000"), ("example.org", 80, "http://example.org:80"),
])
def test_local_tracker_url(host, port, url):
    assert local_tracker_url(host, port) == url
    assert node_endpoint(url + "/") == url + NODE_PREFIX


async def test_a_node_that_fails_to_start_leaves_the_tracker_up_and_says_why(tmp_path):
    hosts = Hosts()
    (tmp_path / "empty-model").mkdir()  # a local directory without config.json: no network asked
    own = NodeSettings(node_id="tracker", public_url=node_endpoint(TRACKER), tracker_url=TRACKER,
                       model=str(tmp_path / "empty-model"), shard=LayerRange(0, 2), state_dir=tmp_path / "k")
    composed = build_app(TrackerSettings(), own, transport=hosts)
    hosts.add("tracker.test", composed)
    async with LifespanManager(composed, startup_timeout=30, shutdown_timeout=30):
        async with httpx.AsyncClient(transport=hosts, base_url=TRACKER) as client:
            for _ in range(100):  # bounded: the node's start fails within seconds
                health = (await client.get("/v1/health")).json()
                if health["local_node"]["error"]:
                    break
                await asyncio.sleep(0.1)
            assert health["status"] == "ok" and health["nodes"] == 0
            assert "empty-model has no config.json" in health["local_node"]["error"]


def test_the_composition_refuses_a_node_it_cannot_reach_as_itself():
    with pytest.raises(ValueError, match="tracker_url"):
        build_app(TrackerSettings(), NodeSettings(node_id="t", public_url=node_endpoint(TRACKER)))
    with pytest.raises(ValueError, match="/node"):
        build_app(TrackerSettings(), NodeSettings(node_id="t", public_url=TRACKER, tracker_url=TRACKER))
