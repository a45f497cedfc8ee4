"""The tracker as a relay (ADR-0045): the real tracker app under uvicorn on 127.0.0.1, a stand-in node
behind a real tunnel. Only a registered node may attach, for its own id; its relayed endpoint is
probed through the tunnel, admitted, routed with the relay's cost, and unreachable while detached."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from meshnet.relay.backoff import Backoff
from meshnet.relay.hub import attach_target
from meshnet.relay.tunnel import NodeTunnel
from meshnet.tracker.app import build_app
from meshnet.tracker.routing import RELAY_LATENCY_FLOOR_S
from meshnet.tracker.service import TrackerSettings
from tests.payloads import SignAsNodes, capability_report, node_key, public_key, registration, signed
from tests.service.test_relay import NODE, NODE_APP, serving

MODEL = "tiny-llama"


async def wait_until(check, timeout_s: float = 10.0):
    for _ in range(int(timeout_s / 0.05)):
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def shard() -> dict:
    return {"model": MODEL, "shard_start": 0, "shard_end": 3, "num_layers": 4, "tier": "pinned", "entry": True,
            "report": capability_report(MODEL, 0, 3)}


@contextlib.asynccontextmanager
async def tracker_with_relayed_node(register: bool = True, backoff: Backoff | None = None):
    app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:", probe_interval_s=0.2, probe_timeout_s=2.0))
    async with serving(NODE_APP) as local, serving(app, lifespan="on") as tracker, \
            httpx.AsyncClient(base_url=tracker, auth=SignAsNodes(), timeout=10) as http:
        tunnel = NodeTunnel(tracker, NODE, node_key(NODE), local, backoff=backoff or Backoff(0.05, 0.2))
        if register:
            body = registration(NODE, tunnel.endpoint, shards=[shard()], relay_url=tracker, relay_rtt_s=0.01)
            resp = await http.post("/v1/nodes/register", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["reachable"] is False  # not attached yet: the relay answers 404 for it
        task = asyncio.create_task(tunnel.run())
        try:
            yield tracker, http, tunnel, app
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_registered_node_attaches_and_is_admitted_and_routed_through_the_relay():
    async with tracker_with_relayed_node() as (tracker, http, tunnel, app):
        await asyncio.wait_for(tunnel.attached.wait(), 10)

        async def routed():
            resp = await http.get("/v1/route", params={"model": MODEL})
            return resp.json() if resp.status_code == 200 else None

        route = await wait_until(routed)
        assert [(h["node_id"], h["endpoint"]) for h in route["hops"]] == [(NODE, f"{tracker}/v1/relay/{NODE}")]
        node = (await http.get("/v1/nodes")).json()["nodes"][0]
        assert node["reachable"] is True
        health = await http.get(f"/v1/relay/{NODE}/v1/health")
        assert health.json() == {"node_id": NODE, "status": "ok"}
        # the relay leg counts in the route cost: the node's measured 0.01 s (over the floor)
        [candidate] = app.state.service.candidates(MODEL, 4)
        assert candidate.latency_s == 0.01 > RELAY_LATENCY_FLOOR_S
        assert "meshnet_relayed_nodes 1.0" in (await http.get("/metrics")).text
        beat = await http.post(f"/v1/nodes/{NODE}/heartbeat", json={"shards": [shard()], "stats": {"relay_rtt_s": 0.02}})
        assert beat.status_code == 200, beat.text
        [candidate] = app.state.service.candidates(MODEL, 4)
        assert candidate.latency_s == 0.02  # the latest measured round trip counts


async def test_a_closed_tunnel_makes_the_node_unreachable_until_it_attaches_again():
    async with tracker_with_relayed_node(backoff=Backoff(1.5, 1.5)) as (tracker, http, tunnel, app):
        await asyncio.wait_for(tunnel.attached.wait(), 10)

        async def reachable(value: bool):
            nodes = (await http.get("/v1/nodes")).json()["nodes"]
            return nodes[0]["reachable"] is value and nodes[0]

        await wait_until(lambda: reachable(True))
        await tunnel._conn.close()  # the tunnel drops; the node dials again after 0.75-1.5 s
        down = await wait_until(lambda: reachable(False), 1.0)
        assert down["reach_error"] == "its relay tunnel closed (the node dials again by itself)"
        assert (await http.get("/v1/route", params={"model": MODEL})).status_code == 503
        await wait_until(lambda: asyncio.sleep(0, tunnel.attaches >= 2 and tunnel.attached.is_set()))
        await wait_until(lambda: reachable(True), 3.0)  # probed at once on attach
        assert tunnel.attaches == 2


async def test_only_a_registered_node_may_attach_for_its_own_id():
    async with tracker_with_relayed_node(register=False) as (tracker, http, tunnel, app):
        url = tracker.replace("http://", "ws://") + f"/v1/tunnel/{NODE}"
        path = attach_target(tracker.removeprefix("http://"), f"/v1/tunnel/{NODE}")
        cases = {"unregistered": signed(NODE, "GET", path), "unsigned": {},
                 "as another node": signed("n-other", "GET", path)}
        got = {}
        for name, headers in cases.items():
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url, additional_headers=headers, proxy=None):
                    pass
            got[name] = refused.value.response.status_code
        assert got == {"unregistered": 404, "unsigned": 401, "as another node": 403}
        assert tunnel.attaches == 0
        resp = await http.get(f"/v1/relay/{NODE}/v1/health")
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "relay_unknown_node"


async def test_node_key_endpoint_serves_bound_keys():
    async with tracker_with_relayed_node() as (tracker, http, tunnel, app):
        resp = await http.get(f"/v1/nodes/{NODE}/key")
        assert resp.json() == {"node_id": NODE, "public_key": public_key(NODE)}
        missing = await http.get("/v1/nodes/n-nobody/key")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_node"
