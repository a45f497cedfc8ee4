"""Tracker inputs with numbers out of bounds are 422s naming the field, and one node's bad
report never breaks routing for the others (meshnet.tracker.registry)."""

from __future__ import annotations

import json

import pytest

from meshnet.tracker.app import build_app
from meshnet.tracker.service import TrackerSettings
from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, registration

MODEL = "tiny-llama"
REPORT = capability_report(MODEL, 0, 3, tokens_per_s=10.0)


def shard(**over) -> dict:
    return {"model": MODEL, "shard_start": 0, "shard_end": 3, "entry": True, "report": REPORT, **over}


@pytest.fixture
async def tracker(asgi_client):
    app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:"), run_loop=False, transport=HealthyNodes())
    return await asgi_client(app, "http://tracker", raise_app_exceptions=False, auth=SignAsNodes())


@pytest.mark.parametrize("over, field", [
    ({"model": "foreign", "num_layers": 10**7}, "shards.0.num_layers"),
    ({"model": "foreign", "num_layers": 4, "shard_end": 9}, "shards.0.num_layers"),
    ({"shard_end": 10**9}, "shards.0.shard_end"),
])
async def test_layer_numbers_are_bounded(tracker, over, field):
    resp = await tracker.post("/v1/nodes/register", json=registration("node-a", "http://a:1", shards=[shard(**over)]))
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["message"].startswith(f"invalid field '{field}'")


@pytest.mark.parametrize("stats, param", [
    ({"latency_s": "x"}, "stats.latency_s"),            # not a stat of the protocol
    ({"sessions": "many"}, "stats.sessions"),
    ({"tokens_per_s": -1}, "stats.tokens_per_s"),
    ({"decode_latency_s": float("inf")}, "stats.decode_latency_s"),
    ({"requests_running": 1.5}, "stats.requests_running"),
])
async def test_malformed_heartbeat_stats_are_refused_and_routing_keeps_working(tracker, stats, param):
    node = registration("node-a", "http://a:1", shards=[shard()])
    assert (await tracker.post("/v1/nodes/register", json=node)).status_code == 200
    body = json.dumps({"shards": [shard()], "stats": stats})  # inf as the non-standard JSON token Infinity
    resp = await tracker.post("/v1/nodes/node-a/heartbeat", content=body)
    assert resp.status_code == 422 and resp.json()["error"]["param"] == param
    route = await tracker.get("/v1/route", params={"model": MODEL})
    assert route.status_code == 200 and route.json()["hops"][0]["node_id"] == "node-a"
