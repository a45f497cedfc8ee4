"""Measured throughput (ADR-0068), tracker in-process: a holder that claims far more tokens/s than the
tracker's own timing of its decode step shows stops drawing the routes; honest claims stand.

The fake nodes of :mod:`tests.service.test_admission_and_quarantine` compute ``tanh``; here each
host's forward also takes a fixed time, its real speed, whatever it claims."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from meshnet.tracker.node_api import probe_speed
from tests.service.test_admission_and_quarantine import MODEL, ComputingNodes, node, tracker_client, verification


class TimedNodes(ComputingNodes):
    """:class:`ComputingNodes` whose forward takes ``seconds[host]`` (default 0)."""

    def __init__(self, seconds: dict[str, float]) -> None:
        super().__init__()
        self.seconds = seconds

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/forward":
            await asyncio.sleep(self.seconds.get(request.url.host, 0.0))
        return await super().handle_async_request(request)


def claiming(node_id: str, tokens_per_s: float) -> dict:
    """A holder of layers 0-3 whose doctor report claims ``tokens_per_s``."""
    body = node(node_id, 0, 3)
    body["shards"][0]["report"]["tokens_per_s"] = tokens_per_s
    return body


@pytest.fixture
async def timed(asgi_client):
    # the liar is the slower of the two (100 ms a step against 10) and claims 50 times the honest figure
    client = await tracker_client(asgi_client, TimedNodes({"liar.test": 0.100, "honest.test": 0.010}))
    for node_id, claim in (("honest", 100.0), ("liar", 5000.0)):
        assert (await client.post("/v1/nodes/register", json=claiming(node_id, claim))).status_code == 200
        assert (await verification(client, node_id))["admitted"] is True
    return client


async def probe_all(client) -> list[str]:
    """Run every speed probe the tracker has due, as its control loop would; the nodes probed."""
    svc = client.app.state.service
    due = svc.take_speed_probes()
    await asyncio.gather(*(probe_speed(client.app, holder, model, hidden) for holder, model, hidden in due))
    return sorted(holder.node_id for holder, _, _ in due)


async def route_of(client) -> list[str]:
    resp = await client.get("/v1/route", params={"model": MODEL})
    assert resp.status_code == 200, resp.text
    return [h["node_id"] for h in resp.json()["hops"]]


async def test_a_claim_the_probes_refute_no_longer_draws_the_route(timed):
    assert await route_of(timed) == ["liar"]  # believed: 5,000 tokens/s
    assert await probe_all(timed) == ["honest", "liar"]
    assert await probe_all(timed) == []  # each shard once per interval
    assert await route_of(timed) == ["honest"]
    view = {n["node_id"]: n["shards"][0] for n in (await timed.get("/v1/nodes")).json()["nodes"]}
    assert view["liar"]["claim_lost"] is True and view["honest"]["claim_lost"] is False
    # a probe times a 100 ms and a 10 ms step plus the in-process call: at most 10 and 100 tokens/s
    assert 0 < view["liar"]["probed_tokens_per_s"] <= 10 < view["honest"]["probed_tokens_per_s"] <= 100
    svc = timed.app.state.service
    candidates = {c.node_id: c.tokens_per_s for c in svc.candidates(MODEL, 4)}
    assert candidates["honest"] == view["honest"]["routed_tokens_per_s"] == 100.0
    assert candidates["liar"] == view["liar"]["routed_tokens_per_s"] < 100.0  # its probe x the honest inflation


async def test_honest_claims_within_the_factor_stand_exactly(asgi_client):
    """Each shard probed three times (the best counts, as in the tracker's loop over several
    intervals): a probe that a loaded host stalled does not strip an honest claim."""
    client = await tracker_client(asgi_client, TimedNodes({"a.test": 0.010, "b.test": 0.012}),
                                  speed_probe_interval_s=1e-6)
    for node_id, claim in (("a", 120.0), ("b", 90.0)):
        await client.post("/v1/nodes/register", json=claiming(node_id, claim))
        await verification(client, node_id)
    for _ in range(3):
        assert await probe_all(client) == ["a", "b"]
    assert {c.node_id: c.tokens_per_s for c in client.app.state.service.candidates(MODEL, 4)} == \
        {"a": 120.0, "b": 90.0}
    assert await route_of(client) == ["a"]
    assert client.app.state.service.claims_lost == set()


async def test_lone_holders_of_their_layers_are_not_probed_and_zero_turns_the_probes_off(asgi_client):
    client = await tracker_client(asgi_client)
    await client.post("/v1/nodes/register", json=claiming("only", 5000.0))
    await verification(client, "only")
    assert await probe_all(client) == []  # no rival to draw traffic from
    tail = node("tail", 4, 7)
    tail["shards"][0]["report"]["tokens_per_s"] = 5000.0
    await client.post("/v1/nodes/register", json=tail)
    await verification(client, "tail")
    assert await probe_all(client) == []  # a chain of lone holders: none has a rival
    client = await tracker_client(asgi_client, speed_probe_interval_s=0)
    for node_id in ("a", "b"):
        await client.post("/v1/nodes/register", json=claiming(node_id, 100.0))
        await verification(client, node_id)
    assert await probe_all(client) == []


async def test_placement_counts_a_node_whose_claim_was_refuted_at_its_judged_speed(timed):
    from meshnet.tracker.rebalance import placement_inputs

    svc = timed.app.state.service

    def placed() -> dict[str, float]:
        return {n.node_id: n.tokens_per_s for n in placement_inputs(svc)[0]}

    assert placed() == {"honest": 100.0, "liar": 5000.0}  # believed until probed: it would get the widest range
    await probe_all(timed)
    routed = {n["node_id"]: n["shards"][0]["routed_tokens_per_s"] for n in (await timed.get("/v1/nodes")).json()["nodes"]}
    assert placed() == {"honest": 100.0, "liar": routed["liar"]} and routed["liar"] < 100.0
