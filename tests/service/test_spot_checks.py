"""Spot-checks at the entry (ADR-0042): real node apps over ASGI with the tiny seeded model.

The entry holds layers [0, 2); ``c1``, ``c2`` hold [2, 4) honestly, ``bad`` holds [2, 4) with
noise on one weight (:class:`tests.corrupt.Corruption`). Every session is checked
(rate 1). The generation's tokens are those of an honest route whatever the check finds.
"""

from __future__ import annotations

import contextlib
import random

import httpx
import pytest

from meshnet.errors import NotFound
from meshnet.dataplane.failover import MeshLink
from meshnet.dataplane.chain import ChainEnd
from meshnet.gateway.pipeline import GenerationStats, Orchestrator, OrchestratorSettings
from meshnet.gateway.spotcheck import SpotChecker
from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from tests.corrupt import Corruption
from meshnet.node.entry import LocalEntry
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from meshnet.protocol.openai import SamplingParams
from meshnet.protocol.route import Hop, Route as MeshRoute

MODEL = "tiny-llama"
PROMPT = list(range(3, 40))


@pytest.fixture
async def mesh(tiny_model_path):
    """``(entry runtime, client reaching http://c1, http://c2, http://bad)``."""
    path = tiny_model_path(MODEL)
    entry = NodeRuntime()
    entry.load(MODEL, path, LayerRange(0, 2))
    runtimes = {name: NodeRuntime() for name in ("c1", "c2", "bad")}
    for rt in runtimes.values():
        rt.load(MODEL, path, LayerRange(2, 4))
    Corruption(layer=3, scale=5.0).on_hop_call(runtimes["bad"])  # tiny model: 0.5 moves it only 0.036
    async with contextlib.AsyncExitStack() as stack:
        mounts = {}
        for name, rt in runtimes.items():
            from asgi_lifespan import LifespanManager

            app = build_app(NodeSettings(node_id=name, port=1), runtime=rt)
            await stack.enter_async_context(LifespanManager(app))
            mounts[f"http://{name}"] = httpx.ASGITransport(app=app)
        client = await stack.enter_async_context(httpx.AsyncClient(mounts=mounts))
        yield entry, client


def holders(*names: str):
    """Route provider: the first of ``names`` not excluded, with a ticket naming it (these nodes
    have no tracker key: they take any); none left is a NotFound (no route)."""
    async def routes(model, layers, exclude, session_id, like=None):
        for name in names:
            if name not in exclude:
                return MeshRoute([Hop(name, f"http://{name}", layers)], f"ticket-naming-{name}")
        raise NotFound(f"no node serves layers {layers}", code="model_loading")
    return routes


async def generate(entry, client, routes, *, checked: bool = True):
    """``(tokens, stats, failures reported, quarantine reports, checker)`` of one generation; each
    report's ticket must be the one whose route named the reported node."""
    failures, quarantines = [], []

    async def report(node_id, reason, ticket=None):
        assert ticket == f"ticket-naming-{node_id}"
        failures.append(node_id)

    async def quarantine(node_id, model, hop, witnesses, distances, limit, session, ticket, evidence):
        assert ticket == f"ticket-naming-{node_id}"  # the hop's own ticket, or the witness route's
        quarantines.append((node_id, witnesses, distances))

    checker = SpotChecker(1.0 if checked else 0.0, client=client, routes=routes, report=quarantine,
                          rng=random.Random(0))
    slot = next(iter(entry.slots.values()))
    orch = Orchestrator(LocalEntry(entry, slot, wire_dtype="float32"), end=ChainEnd("entry", "http://entry"),
                        link=MeshLink(client, routes, report), settings=OrchestratorSettings(chunk_tokens=8),
                        spot_check=checker)
    stats = GenerationStats()
    tokens = [t async for t in orch.generate(PROMPT, SamplingParams(max_tokens=6), stats)]
    return tokens, stats, failures, quarantines, checker


async def test_a_dishonest_hop_is_outvoted_quarantined_and_failed_over_before_it_serves_a_token(mesh):
    entry, client = mesh
    expected, *_ = await generate(entry, client, holders("c1"), checked=False)
    tokens, stats, failures, quarantines, checker = await generate(entry, client, holders("bad", "c1", "c2"))
    assert tokens == expected
    assert [q[:2] for q in quarantines] == [("bad", ["c1", "c2"])]
    distances = quarantines[0][2]
    assert distances["c1|c2"] == 0.0 and distances["bad|c1"] > 0.05 and distances["bad|c2"] > 0.05
    assert failures == ["bad"] and stats.failovers == 1
    assert [h.node_id for h in stats.route] == ["entry", "c1"]
    assert checker.stats.checks == 2 and checker.stats.quarantined == ["bad"]  # the replacement is checked too
    assert checker.stats.distances[-1] == 0.0


async def test_a_dishonest_witness_is_outvoted_and_the_generation_goes_on_untouched(mesh):
    entry, client = mesh
    expected, *_ = await generate(entry, client, holders("c1"), checked=False)
    tokens, stats, failures, quarantines, _ = await generate(entry, client, holders("c1", "bad", "c2"))
    assert tokens == expected
    assert [q[:2] for q in quarantines] == [("bad", ["c1", "c2"])]
    assert failures == [] and stats.failovers == 0 and [h.node_id for h in stats.route] == ["entry", "c1"]


async def test_honest_holders_agree_exactly_and_nothing_is_reported(mesh):
    entry, client = mesh
    tokens, stats, failures, quarantines, checker = await generate(entry, client, holders("c1", "c2"))
    assert quarantines == [] and failures == []
    assert checker.stats.checks == 1 and checker.stats.distances == [0.0]


async def test_two_holders_that_disagree_without_a_third_are_a_dispute_not_a_quarantine(mesh):
    entry, client = mesh
    _, stats, failures, quarantines, checker = await generate(entry, client, holders("c1", "bad"))
    assert quarantines == [] and failures == [] and checker.stats.disputes == 1
    assert [h.node_id for h in stats.route] == ["entry", "c1"]


async def test_a_range_with_no_second_holder_is_counted_unverified(mesh):
    entry, client = mesh
    _, _, _, quarantines, checker = await generate(entry, client, holders("c1"))
    assert quarantines == [] and checker.stats.unverified == 1 and checker.stats.distances == []


def test_the_rate_is_a_probability_per_session():
    checker = SpotChecker(0.25, client=None, routes=None, report=None, rng=random.Random(1))
    draws = sum(checker.draw() for _ in range(10_000))
    assert 2300 < draws < 2700
    assert not any(SpotChecker(0.0, client=None, routes=None, report=None).draw() for _ in range(100))
    with pytest.raises(ValueError):
        SpotChecker(1.5, client=None, routes=None, report=None)
