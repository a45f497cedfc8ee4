"""Every error on a hop is a hop failure; a busy hop is replaced without being reported.

Real node apps over ASGI with the tiny seeded model: the entry holds layers [0, 2), nodes
``c`` and ``full`` hold [2, 4); ``full``'s session cache is over its cap, so it refuses new
sessions (503 ``session_cache_full``). Other hops are URLs nobody can use or fake apps that
answer with a bad frame.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import torch
from asgi_lifespan import LifespanManager
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from meshnet.node import wire
from meshnet.errors import HopFailed, NotFound
from meshnet.node.entry import LocalEntry
from meshnet.dataplane.failover import MeshLink
from meshnet.dataplane.chain import ChainEnd
from meshnet.gateway.pipeline import GenerationStats, Orchestrator, OrchestratorSettings
from meshnet.protocol.openai import SamplingParams
from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from meshnet.node.runtime import NodeRuntime
from meshnet.node.sessions import SessionStore
from meshnet.node.settings import NodeSettings
from meshnet.protocol.route import Hop, Route as MeshRoute

MODEL = "tiny-llama"
HIDDEN = 64
PROMPT = list(range(3, 40))
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello mesh"}], "max_tokens": 4, "temperature": 0}
BAD_URL = "http://::1:8821"  # an unbracketed IPv6 endpoint: httpx raises InvalidURL, not an HTTPError


def fake_node(reply: bytes) -> Starlette:
    """A node whose /v1/forward answers 200 with ``reply`` whatever it is sent."""
    async def forward(request):
        return Response(reply, media_type="application/octet-stream")
    return Starlette(routes=[Route("/v1/forward", forward, methods=["POST"])])


@pytest.fixture
async def mesh(tiny_model_path):
    """``(entry runtime, client reaching http://c, http://full, http://garbage, http://narrow)``."""
    path = tiny_model_path(MODEL)
    entry, c = NodeRuntime(), NodeRuntime()
    full = NodeRuntime(sessions=SessionStore(max_bytes=1))
    entry.load(MODEL, path, LayerRange(0, 2))
    for rt in (c, full):
        rt.load(MODEL, path, LayerRange(2, 4))
    full.forward(model=MODEL, session_id="occupier", layers=LayerRange(2, 4), position=0,
                 hidden=torch.randn(1, 3, HIDDEN))  # holds more than the 1-byte cap: new sessions are refused
    apps = {"c": build_app(NodeSettings(node_id="c", port=1), runtime=c),
            "full": build_app(NodeSettings(node_id="full", port=1), runtime=full),
            "garbage": fake_node(b"not a frame"),
            "narrow": fake_node(wire.encode(torch.zeros(1, 1, HIDDEN // 2), dtype="float32"))}
    async with contextlib.AsyncExitStack() as stack:
        mounts = {}
        for name, app in apps.items():
            await stack.enter_async_context(LifespanManager(app))
            mounts[f"http://{name}"] = httpx.ASGITransport(app=app)
        client = await stack.enter_async_context(httpx.AsyncClient(mounts=mounts))
        yield entry, client


def routes_via(*names: str, calls: list | None = None):
    """Route provider: the first of ``names`` not excluded; none left is a NotFound (no route)."""
    async def routes(model, layers, exclude, session_id):
        if calls is not None:
            calls.append(set(exclude))
        for name in names:
            if name not in exclude:
                return MeshRoute([Hop(name, BAD_URL if name == "bad" else f"http://{name}", layers)])
        raise NotFound(f"no node serves layers {layers}", code="model_loading")
    return routes


def orchestrator(entry, client, routes, reported: list | None = None, **settings) -> Orchestrator:
    """One decode token per step unless ``settings`` says otherwise: the tests here fail the step at a position."""
    settings.setdefault("speculate", 0)

    async def report(node_id, reason, ticket=None):
        if reported is not None:
            reported.append(node_id)

    slot = next(iter(entry.slots.values()))
    return Orchestrator(LocalEntry(entry, slot, wire_dtype="float32"), end=ChainEnd("entry", "http://entry"),
                        link=MeshLink(client, routes, report),
                        settings=OrchestratorSettings(chunk_tokens=8, **settings))


async def generate(orch) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    tokens = [t async for t in orch.generate(PROMPT, SamplingParams(max_tokens=6), stats)]
    return tokens, stats


@pytest.mark.parametrize("first", ["bad", "garbage", "narrow"])
async def test_an_unusable_hop_is_reported_and_replaced_with_the_same_tokens(mesh, first):
    entry, client = mesh
    expected, _ = await generate(orchestrator(entry, client, routes_via("c")))
    reported = []
    got, stats = await generate(orchestrator(entry, client, routes_via(first, "c"), reported))
    assert got == expected and len(got) == 6
    assert reported == [first] and stats.failovers == 1
    assert [h.node_id for h in stats.route] == ["entry", "c"]


async def test_a_full_session_cache_is_busy_so_the_next_holder_serves_and_nothing_is_reported(mesh):
    entry, client = mesh
    expected, _ = await generate(orchestrator(entry, client, routes_via("c")))
    reported, calls = [], []
    got, stats = await generate(orchestrator(entry, client, routes_via("full", "c", calls=calls), reported))
    assert got == expected
    assert reported == [] and stats.failovers == 1  # healthy, only full: not reported to the tracker
    assert calls == [set(), {"full"}] and [h.node_id for h in stats.route] == ["entry", "c"]


class ForgetfulNode(httpx.AsyncBaseTransport):
    """Passes calls to a node app, but before forward call number ``at`` the node loses every
    session (as after an expiry or a restart)."""

    def __init__(self, app, runtime: NodeRuntime, at: int) -> None:
        self.inner, self.runtime, self.at, self.calls = httpx.ASGITransport(app=app), runtime, at, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/forward":
            self.calls += 1
            if self.calls == self.at:
                for sid in {key[0] for key in list(self.runtime.sessions._sessions)}:
                    self.runtime.sessions.release(sid)
        return await self.inner.handle_async_request(request)


async def test_a_hop_that_lost_the_session_gets_it_replayed_and_is_not_reported(tiny_model_path):
    path = tiny_model_path(MODEL)
    entry, c = NodeRuntime(), NodeRuntime()
    entry.load(MODEL, path, LayerRange(0, 2))
    c.load(MODEL, path, LayerRange(2, 4))
    app = build_app(NodeSettings(node_id="c", port=1), runtime=c)
    async with LifespanManager(app):
        async with httpx.AsyncClient(mounts={"http://c": httpx.ASGITransport(app=app)}) as plain:
            expected, _ = await generate(orchestrator(entry, plain, routes_via("c")))
        forgetful = ForgetfulNode(app, c, at=8)  # 5 prefill chunks, then the third decode step
        async with httpx.AsyncClient(mounts={"http://c": forgetful}) as client:
            reported, calls = [], []
            got, stats = await generate(orchestrator(entry, client, routes_via("c", calls=calls), reported))
    assert got == expected
    assert reported == [] and calls == [set(), set()]  # c was asked for again, not excluded
    assert stats.failovers == 1 and [h.node_id for h in stats.route] == ["entry", "c"]


async def test_a_failed_prefill_chunk_cancels_its_sibling_chunks(mesh):
    entry, client = mesh
    orch = orchestrator(entry, client, routes_via("bad"), pipelined=True)
    with pytest.raises(HopFailed, match="hop bad at http://::1:8821") as info:
        await asyncio.wait_for(generate(orch), timeout=30)
    assert info.value.status == 502 and "no other node serves layers 2-3" in info.value.message
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() if "_step" in t.get_coro().__qualname__ and not t.done()]
    assert left == []  # chunks 1..4 were waiting for chunk 0 on the bad hop: cancelled, not leaked
    for _ in range(200):  # the release ends the session in a worker thread when a forward holds the lock
        if len(entry.sessions) == 0:
            break
        await asyncio.sleep(0.01)
    assert len(entry.sessions) == 0


class FakeAgent:
    """Stands in for the tracker agent: routes from a provider, failure reports recorded; its
    tracker client knows no node key (the entry's audits then dispute nothing)."""

    endpoint, signer, tunnel = None, None, None

    def __init__(self, routes) -> None:
        self.session_route, self.reported = routes, []
        self.client = self

    async def node_key(self, node_id):
        return None

    async def report_failure(self, node_id, reason, ticket=None):
        self.reported.append(node_id)


@pytest.fixture
async def entry_app(asgi_client, mesh):
    """``make(*hop names) -> (client of the entry node app, its FakeAgent)``: the entry node's chat
    API, its hops reached over the mesh's client."""
    entry, client = mesh

    async def make(*names: str):
        # the hops are mounted apps reached over HTTP: the entry uses the per-hop HTTP path, not streams
        app = build_app(NodeSettings(node_id="entry", port=1, wire_dtype="float32", hop_streams=False), runtime=entry)
        http = await asgi_client(app, "http://entry")
        app.state.node.http, app.state.node.agent = client, FakeAgent(routes_via(*names))
        return http, app.state.node.agent

    return make


async def test_chat_through_an_unusable_hop_is_a_json_502_naming_the_hop(entry_app):
    http, agent = await entry_app("bad")
    resp = await http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 502 and resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["code"] == "hop_failed"
    assert "hop bad at http://::1:8821 (layers 2-3) failed: InvalidURL" in error["message"]
    assert agent.reported == ["bad"]


async def test_chat_when_the_only_holder_is_full_is_a_503_session_cache_full_naming_it(entry_app):
    http, agent = await entry_app("full")
    resp = await http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "session_cache_full"
    assert "hop full at http://full" in error["message"] and "no other node serves layers" in error["message"]
    assert agent.reported == []


@pytest.mark.parametrize("stream", [False, True])
async def test_an_entry_node_with_a_full_cache_refuses_the_chat_with_a_503(asgi_client, tiny_model_path, stream):
    runtime = NodeRuntime(sessions=SessionStore(max_bytes=1))
    slot = runtime.load(MODEL, tiny_model_path(MODEL), LayerRange(0, 4))
    runtime.run_entry(slot, "occupier", torch.tensor([[5, 6, 7]]), 0, LayerRange(0, 4))
    http = await asgi_client(build_app(NodeSettings(node_id="entry", port=1), runtime=runtime), "http://entry")
    resp = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert resp.status_code == 503 and resp.headers["content-type"] == "application/json"  # before any event
    assert resp.json()["error"]["code"] == "session_cache_full"
    assert "--session-cache-mb" in resp.json()["error"]["hint"]
    assert runtime.sessions.acquire("occupier", slot.key, 3).length == 3  # the live session is untouched


async def test_session_cache_and_ttl_settings_reach_the_store_and_health(asgi_client):
    settings = NodeSettings(node_id="n", port=1, session_cache_bytes=64 * 1024 * 1024, session_ttl_s=42.0)
    app = build_app(settings)
    http = await asgi_client(app, "http://n")
    body = (await http.get("/v1/health")).json()
    assert body["session_cache_bytes"] == 64 * 1024 * 1024 and body["session_ttl_s"] == 42.0
    store = app.state.node.runtime.sessions
    assert (store.max_bytes, store.ttl_s) == (64 * 1024 * 1024, 42.0)


async def test_an_unexpected_error_in_a_node_handler_is_a_json_500(asgi_client, monkeypatch):
    app = build_app(NodeSettings(node_id="n", port=1))
    http = await asgi_client(app, "http://n", raise_app_exceptions=False)
    monkeypatch.setattr(NodeRuntime, "describe", lambda self: 1 / 0)
    resp = await http.get("/v1/health")
    assert resp.status_code == 500 and resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "internal_error"
    assert "ZeroDivisionError" in resp.json()["error"]["message"]
