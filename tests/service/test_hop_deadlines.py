"""A frozen hop is failed over within its deadline; a slow live one is waited for; every ending
releases every hop. Real node apps over ASGI with the tiny seeded model, float32 on the wire.

The entry holds layers [0, 2); nodes ``a`` and ``c`` hold [2, 4). Routes try ``a`` first.
``a`` is wrapped in :class:`FreezingNode`, which stops answering anything from a chosen
forward call on, as a SIGSTOPped process does, until the test resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import httpx
import pytest
from asgi_lifespan import LifespanManager

from meshnet.node import wire
from meshnet.errors import HopFailed, NotFound
from meshnet.dataplane.deadlines import DeadlinePolicy
from meshnet.dataplane.failover import settle_releases
from meshnet.dataplane.failover import MeshLink
from meshnet.dataplane.chain import ChainEnd
from meshnet.gateway.pipeline import GenerationStats, Orchestrator, OrchestratorSettings
from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from meshnet.node.entry import LocalEntry
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from meshnet.protocol.openai import SamplingParams
from meshnet.protocol.route import Hop, Route

MODEL = "tiny-llama"
PROMPT = list(range(3, 40))  # 37 tokens: prefill in chunks of 8 is 5 calls
CHUNK = 8
MAX_TOKENS = 12
POLICY = DeadlinePolicy()    # the shipped numbers: floor 0.5 s, probe 0.5 s


class FreezingNode(httpx.AsyncBaseTransport):
    """A node app that, from forward call number ``at`` on, answers nothing until ``resume`` is
    set: forwards, health probes and releases all hang, as with a SIGSTOPped process. What it
    was sent meanwhile is served once it resumes (the late answers go to nobody).
    ``delay_s`` instead slows forward call ``at`` only, while the node keeps answering probes."""

    def __init__(self, app, *, at: int, delay_s: float | None = None) -> None:
        self.inner, self.at, self.delay_s = httpx.ASGITransport(app=app), at, delay_s
        self.calls, self.resume, self.held = 0, asyncio.Event(), []
        self.frames: list[tuple[int, int]] = []  # (position, tokens) of every forward call

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/forward":
            self.calls += 1
            if self.delay_s is not None and self.calls == self.at:
                await asyncio.sleep(self.delay_s)
        if self.delay_s is None and self.calls >= self.at and not self.resume.is_set():
            held = asyncio.ensure_future(self._after_resume(request))  # in the kernel's buffers meanwhile
            self.held.append(held)
            return await asyncio.shield(held)
        return await self.inner.handle_async_request(request)

    async def _after_resume(self, request: httpx.Request) -> httpx.Response:
        await self.resume.wait()
        return await self.inner.handle_async_request(request)


class Recorder(httpx.AsyncBaseTransport):
    """Passes calls to a node app and records ``(position, tokens)`` of each forward frame."""

    def __init__(self, app) -> None:
        self.inner, self.frames = httpx.ASGITransport(app=app), []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/forward":
            body = await request.aread()
            self.frames.append((int(request.headers["X-Meshnet-Position"]), wire.decode(body).shape[1]))
        return await self.inner.handle_async_request(request)


@pytest.fixture
async def mesh(tiny_model_path):
    """``make(a_transport_factory) -> (entry runtime, {name: runtime}, client, {name: transport})``."""
    path = tiny_model_path(MODEL)
    async with contextlib.AsyncExitStack() as stack:
        async def make(wrap_a):
            runtimes = {name: NodeRuntime() for name in ("entry", "a", "c")}
            runtimes["entry"].load(MODEL, path, LayerRange(0, 2))
            transports = {}
            for name in ("a", "c"):
                runtimes[name].load(MODEL, path, LayerRange(2, 4))
                app = build_app(NodeSettings(node_id=name, port=1), runtime=runtimes[name])
                await stack.enter_async_context(LifespanManager(app))
                transports[name] = wrap_a(app) if name == "a" else Recorder(app)
            client = await stack.enter_async_context(
                httpx.AsyncClient(mounts={f"http://{n}": t for n, t in transports.items()}))
            return runtimes, client, transports
        yield make


def routes_via(*names: str):
    async def routes(model, layers, exclude, session_id):
        for name in names:
            if name not in exclude:
                return Route([Hop(name, f"http://{name}", layers)])
        raise NotFound(f"no node serves layers {layers}", code="model_loading")
    return routes


def orchestrator(runtimes, client, routes, reported: list) -> Orchestrator:
    """One decode token per step (no speculation): the tests here freeze or slow the step at a position."""
    async def report(node_id, reason, ticket=None):
        reported.append(node_id)

    entry = runtimes["entry"]
    return Orchestrator(LocalEntry(entry, next(iter(entry.slots.values())), wire_dtype="float32"),
                        end=ChainEnd("entry", "http://entry"), link=MeshLink(client, routes, report),
                        settings=OrchestratorSettings(chunk_tokens=CHUNK, deadlines=POLICY, speculate=0))


async def timed_generate(orch) -> tuple[list[int], list[float], GenerationStats]:
    stats, tokens, stamps = GenerationStats(), [], []
    async for token in orch.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS), stats):
        tokens.append(token)
        stamps.append(time.monotonic())
    return tokens, stamps, stats


async def undisturbed(make) -> list[int]:
    runtimes, client, _ = await make(httpx.ASGITransport)
    tokens, _, _ = await timed_generate(orchestrator(runtimes, client, routes_via("c"), []))
    return tokens


async def test_a_frozen_hop_is_failed_over_within_its_deadline_with_the_same_tokens(mesh):
    expected = await undisturbed(mesh)
    freeze_at = 5 + 4  # the 5 prefill chunks, then the fourth decode step (position 40) hangs
    runtimes, client, transports = await mesh(lambda app: FreezingNode(app, at=freeze_at))
    reported = []
    got, stamps, stats = await timed_generate(orchestrator(runtimes, client, routes_via("a", "c"), reported))
    stall_s = max(b - a for a, b in zip(stamps, stamps[1:]))
    print(f"stall on a frozen hop: {stall_s:.2f} s (deadline {POLICY.floor_s} s + probe {POLICY.probe_timeout_s} s)")

    assert got == expected and len(got) == MAX_TOKENS
    assert POLICY.floor_s <= stall_s < POLICY.floor_s + POLICY.probe_timeout_s + 1.0
    assert reported == ["a"] and stats.failovers == 1 and stats.deadline_misses == 1
    assert [h.node_id for h in stats.route] == ["entry", "c"]
    # the replay: 40 tokens of history in ceil(40 / 8) = 5 chunks, not 5 chunks + 3 single steps
    history_tokens = len(PROMPT) + 3
    replay = [f for f in transports["c"].frames if f[0] < history_tokens]
    assert len(replay) == math.ceil(history_tokens / CHUNK) == 5
    assert replay == [(p, CHUNK) for p in range(0, history_tokens, CHUNK)]
    assert transports["c"].frames[len(replay):] == [(p, 1) for p in range(history_tokens, history_tokens + 8)]

    # the generation ended while ``a`` was still frozen; its release waits in its buffers, and
    # once it resumes (its late forward served too) it holds nothing
    assert len(runtimes["a"].sessions) == 1
    a = transports["a"]
    a.resume.set()
    await asyncio.gather(*a.held, return_exceptions=True)
    await settle_releases(5.0)
    assert len(runtimes["a"].sessions) == 0 and runtimes["a"].sessions.nbytes == 0
    assert len(runtimes["c"].sessions) == 0 and len(runtimes["entry"].sessions) == 0


async def test_a_slow_hop_that_answers_its_probe_is_waited_for_not_failed_over(mesh):
    expected = await undisturbed(mesh)
    runtimes, client, transports = await mesh(lambda app: FreezingNode(app, at=5 + 4, delay_s=1.5))
    reported = []
    got, stamps, stats = await timed_generate(orchestrator(runtimes, client, routes_via("a", "c"), reported))
    assert got == expected
    assert reported == [] and stats.failovers == 0 and stats.deadline_misses == 0
    assert [h.node_id for h in stats.route] == ["entry", "a"]
    assert max(b - a for a, b in zip(stamps, stamps[1:])) >= 1.5
    assert transports["c"].frames == []


async def test_a_frozen_first_call_fails_over_after_the_cold_allowance(mesh):
    """Nothing observed yet (the first prefill chunk): the deadline is ``cold_s``."""
    expected = await undisturbed(mesh)
    runtimes, client, transports = await mesh(lambda app: FreezingNode(app, at=1))
    reported = []
    t0 = time.monotonic()
    got, _, stats = await timed_generate(orchestrator(runtimes, client, routes_via("a", "c"), reported))
    assert got == expected and reported == ["a"] and stats.deadline_misses == 1
    assert POLICY.cold_s <= time.monotonic() - t0 < POLICY.cold_s + POLICY.probe_timeout_s + 2.0
    transports["a"].resume.set()
    await asyncio.gather(*transports["a"].held, return_exceptions=True)
    await settle_releases(5.0)
    assert len(runtimes["a"].sessions) == 0


@pytest.mark.parametrize("ending", ["finish", "disconnect", "no_replacement"])
async def test_every_ending_releases_the_session_on_every_hop(mesh, ending):
    runtimes, client, transports = await mesh(lambda app: FreezingNode(app, at=5 + 2))
    routes = routes_via("c") if ending != "no_replacement" else routes_via("a")
    orch = orchestrator(runtimes, client, routes, [])
    stats = GenerationStats()
    tokens = orch.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS), stats)
    if ending == "finish":
        assert len([t async for t in tokens]) == MAX_TOKENS
    elif ending == "disconnect":
        async with contextlib.aclosing(tokens):
            async for _ in tokens:
                break  # the client went away after the first token
    else:
        with pytest.raises(HopFailed, match="missed its .* deadline"):
            _ = [t async for t in tokens]
    transports["a"].resume.set()
    await asyncio.gather(*transports["a"].held, return_exceptions=True)
    await settle_releases(5.0)
    assert {name: len(rt.sessions) for name, rt in runtimes.items()} == {"entry": 0, "a": 0, "c": 0}
