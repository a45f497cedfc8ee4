"""Overlapping shards and in-process failover: real node apps over ASGI, tiny seeded model.

The entry node holds layers [0, 2); node ``b`` holds [1, 4) (overlapping) and node ``c``
[2, 4). A hop through ``b`` starts inside its shard (``X-Meshnet-Start-Layer: 2``)."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from asgi_lifespan import LifespanManager

from meshnet.node.entry import LocalEntry
from meshnet.dataplane.failover import MeshLink
from meshnet.dataplane.chain import ChainEnd
from meshnet.gateway.pipeline import GenerationStats, Orchestrator, OrchestratorSettings
from meshnet.protocol.openai import SamplingParams
from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from meshnet.protocol.route import Hop, Route

MODEL = "tiny-llama"
PROMPT = list(range(3, 40))


@pytest.fixture
async def mesh(tiny_model_path):
    path = tiny_model_path(MODEL)
    runtimes = {}
    for name, (a, b) in {"entry": (0, 2), "b": (1, 4), "c": (2, 4)}.items():
        runtimes[name] = NodeRuntime()
        runtimes[name].load(MODEL, path, LayerRange(a, b))
    async with contextlib.AsyncExitStack() as stack:
        mounts = {}
        for name in ("b", "c"):
            app = build_app(NodeSettings(node_id=name, port=1), runtime=runtimes[name])
            await stack.enter_async_context(LifespanManager(app))
            mounts[f"http://{name}"] = httpx.ASGITransport(app=app)
        client = await stack.enter_async_context(httpx.AsyncClient(mounts=mounts))
        yield runtimes, client


def orchestrator(runtimes, client, routes, reported=None):
    async def report(node_id, reason, ticket=None):
        if reported is not None:
            reported.append(node_id)

    slot = next(iter(runtimes["entry"].slots.values()))
    return Orchestrator(LocalEntry(runtimes["entry"], slot, wire_dtype="float32"),
                        end=ChainEnd("entry", "http://entry"), link=MeshLink(client, routes, report),
                        settings=OrchestratorSettings(chunk_tokens=8))


async def generate(orch) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    tokens = [t async for t in orch.generate(PROMPT, SamplingParams(max_tokens=12), stats)]
    return tokens, stats


def via(name: str):
    async def routes(model, layers, exclude, session_id):
        return Route([Hop(name, f"http://{name}", layers)])
    return routes


async def test_overlapping_route_starts_inside_the_shard_and_matches(mesh):
    runtimes, client = mesh
    plain, plain_stats = await generate(orchestrator(runtimes, client, via("c")))
    overlap, stats = await generate(orchestrator(runtimes, client, via("b")))
    assert overlap == plain and len(plain) == 12
    assert [h.to_json() for h in stats.route] == [
        {"node_id": "entry", "endpoint": "http://entry", "start_layer": 0, "end_layer": 1},
        {"node_id": "b", "endpoint": "http://b", "start_layer": 2, "end_layer": 3}]
    # b ran only layers 2-3 of its 1-3 shard: every prompt and decode token went through it once
    assert runtimes["b"].tokens_processed == len(PROMPT) + len(overlap) - 1


async def test_a_failed_hop_is_replaced_and_replayed_with_the_same_tokens(mesh):
    runtimes, client = mesh
    expected, _ = await generate(orchestrator(runtimes, client, via("c")))
    calls, reported = [], []

    async def routes(model, layers, exclude, session_id):
        calls.append(frozenset(exclude))
        if "dead" not in exclude:
            return Route([Hop("dead", "http://127.0.0.1:9", layers)])  # nothing listens on port 9
        return Route([Hop("c", "http://c", layers)])

    got, stats = await generate(orchestrator(runtimes, client, routes, reported))
    assert got == expected
    assert reported == ["dead"] and stats.failovers == 1
    assert calls == [frozenset(), frozenset({"dead"})]
    assert [h.node_id for h in stats.route] == ["entry", "c"]
