"""Tracker service (meshnet.tracker.app) in-process: registry, coverage, routes, demand, operator auth.

No control loop (``run_loop=False``), so nothing rebalances behind the test's back; nodes
are fake registrations that report shards with capability reports.
"""

from __future__ import annotations

import json
import time

import pytest

from meshnet.layers import LayerRange
from meshnet.protocol.route import Hop
from meshnet.tracker.app import build_app
from meshnet.protocol.control import DEFAULT_VRAM_BYTES
from meshnet.tracker.service import TrackerSettings
from tests.payloads import SignAsNodes, capability_report, public_key, registration, route_ticket, signed
from tests.fake_nodes import HealthyNodes

MODEL = "tiny-llama"
PASSED = "passed"


def report(start: int, end: int, kind: str | None = PASSED) -> dict | None:
    """A capability report of layers ``start..end``: ``passed``, ``failed`` or None (missing)."""
    if kind is None:
        return None
    return capability_report(MODEL, start, end, passed=kind == PASSED,
                             reason=None if kind == PASSED else "forward mismatch")


def shard(start: int, end: int, *, entry: bool | None = None, report_kind: str | None = PASSED) -> dict:
    """A shard payload with the public inclusive ``shard_start``/``shard_end``."""
    return {"model": MODEL, "shard_start": start, "shard_end": end, "entry": start == 0 if entry is None else entry,
            "tier": "pinned", "quantization": "bfloat16", "report": report(start, end, report_kind)}


def node(node_id: str, *shards: dict, **extra) -> dict:
    return registration(node_id, f"http://{node_id}.test:8000", vram_bytes=2 * 1024**3, max_loaded_shards=2,
                        shards=list(shards), **extra)


@pytest.fixture
def make_tracker(asgi_client):
    async def make(**settings):
        app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:", **settings), run_loop=False,
                        transport=HealthyNodes())
        client = await asgi_client(app, "http://tracker", auth=SignAsNodes())
        client.service = app.state.service  # for checks of state the HTTP views do not show
        return client

    return make


@pytest.fixture
async def tracker(make_tracker):
    return await make_tracker()


async def register(client, payload: dict) -> str:
    resp = await client.post("/v1/nodes/register", json=payload)
    assert resp.status_code == 200, resp.text
    return resp.json()["node_id"]


def assert_envelope(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert {"message", "type", "code"} <= set(body["error"])
    assert body["error"]["code"] == code
    return body


# ---- registration ---------------------------------------------------------------------------


async def test_register_returns_id_and_heartbeat_interval(tracker):
    resp = await tracker.post("/v1/nodes/register", json=registration("node-a", "http://a.test:8000/"))
    assert resp.status_code == 200
    body = resp.json()
    assert body["node_id"] == "node-a" and body["heartbeat_interval_s"] == 10.0


async def test_a_registration_names_its_node_id(tracker):
    body = registration("node-a", "http://a.test:8000")
    del body["node_id"]  # the id goes with the node's key: the node chooses it, once
    assert_envelope(await tracker.post("/v1/nodes/register", json=body), 422, "invalid_field")


@pytest.mark.parametrize("override, field", [
    ({"max_loaded_shards": 0}, "max_loaded_shards"),
    ({"vram_bytes": -1}, "vram_bytes"),
    ({"endpoint": "node-a:8000"}, "endpoint"),
    ({"endpoint": ""}, "endpoint"),
    ({"endpoint": "http://::1:8821"}, "endpoint"),  # an IPv6 literal without brackets
    ({"endpoint": "http://node-a:99999"}, "endpoint"),
    ({"quantizations": ["fp8"]}, "quantizations"),
    ({"shards": [{"model": MODEL, "shard_start": 3, "shard_end": 1}]}, "shard_end"),
    ({"shards": [{"model": MODEL, "shard_start": -1, "shard_end": 1}]}, "shards.0.shard_start"),
])
async def test_register_validation_is_422_naming_the_field(tracker, override, field):
    resp = await tracker.post("/v1/nodes/register", json={**node("node-a"), **override})
    error = assert_envelope(resp, 422, "invalid_field")["error"]
    assert field in error["message"]
    assert (await tracker.get("/v1/nodes")).json()["nodes"] == []


async def test_unknown_quantization_is_labelled_with_its_field(tracker):
    resp = await tracker.post("/v1/nodes/register", json={**node("node-a"), "quantizations": ["fp8"]})
    error = assert_envelope(resp, 422, "invalid_field")["error"]
    assert error["message"] == ("invalid field 'quantizations.0': "
                                "Input should be 'bfloat16', 'int8', 'int4', 'nf4' or 'float32'")


async def test_a_renamed_heartbeat_field_is_a_422_naming_it(tracker):
    await register(tracker, node("node-a", shard(0, 3)))
    # a node that still sends the old name of a stats field is refused, not silently read as 0
    resp = await tracker.post("/v1/nodes/node-a/heartbeat", json={"shards": [], "stats": {"in_flight": 1}})
    error = assert_envelope(resp, 422, "invalid_field")["error"]
    assert error["message"] == "invalid field 'stats.in_flight': unknown field"


async def test_register_body_that_is_not_json_is_400(tracker):
    resp = await tracker.post("/v1/nodes/register", content=b"not json")
    assert_envelope(resp, 400, "invalid_request")


async def test_omitted_memory_defaults_to_8_gib(tracker):
    await register(tracker, registration("node-a", "http://a.test:8000/"))
    (view,) = (await tracker.get("/v1/nodes")).json()["nodes"]
    assert view["vram_bytes"] == DEFAULT_VRAM_BYTES == 8 * 1024**3
    assert view["memory_budget_bytes"] == int(8 * 1024**3 * 0.8)
    assert view["endpoint"] == "http://a.test:8000"  # trailing slash dropped
    assert view["quantization"] == "bfloat16" and view["slots_total"] == 1
    # floor(8 GiB * 0.8 / 57,600 bytes per bfloat16 tiny-llama layer) = 119,304 fits, shown as the
    # whole model: tiny-llama has 4 layers
    assert view["max_assignable_layers"][MODEL] == 4 == min(4, 8 * 1024**3 * 4 // 5 // 57_600)


# ---- coverage and routes ---------------------------------------------------------------------


async def test_two_nodes_make_the_model_routable(tracker):
    await register(tracker, node("node-a", shard(0, 1)))
    await register(tracker, node("node-b", shard(2, 3)))
    cov = (await tracker.get(f"/v1/coverage/{MODEL}")).json()
    assert cov["model"] == MODEL and cov["num_layers"] == 4
    assert cov["segments"] == [{"start_layer": 0, "end_layer": 3, "node_count": 1}]
    assert cov["covered_layers"] == 4 and cov["routable"] is True
    (listed,) = (await tracker.get("/v1/coverage")).json()["models"]
    assert listed["routable"] is True


async def test_overlap_shows_in_segments(tracker):
    await register(tracker, node("node-a", shard(0, 1)))
    await register(tracker, node("node-b", shard(2, 3)))
    await register(tracker, node("node-c", shard(1, 3)))
    cov = (await tracker.get(f"/v1/coverage/{MODEL}")).json()
    assert cov["segments"] == [{"start_layer": 0, "end_layer": 0, "node_count": 1},
                               {"start_layer": 1, "end_layer": 3, "node_count": 2}]


@pytest.mark.parametrize("report_kind", ["failed", None], ids=["failed-report", "missing-report"])
async def test_shard_without_a_passed_report_is_not_counted(tracker, report_kind):
    await register(tracker, node("node-a", shard(0, 1)))
    await register(tracker, node("node-b", shard(2, 3, report_kind=report_kind)))
    cov = (await tracker.get(f"/v1/coverage/{MODEL}")).json()
    assert cov["segments"] == [{"start_layer": 0, "end_layer": 1, "node_count": 1},
                               {"start_layer": 2, "end_layer": 3, "node_count": 0}]
    assert cov["covered_layers"] == 2 and cov["routable"] is False
    views = {n["node_id"]: n for n in (await tracker.get("/v1/nodes")).json()["nodes"]}
    assert views["node-a"]["shards"][0]["admitted"] is True
    assert views["node-b"]["shards"][0]["admitted"] is False


async def test_full_coverage_without_an_entry_shard_is_not_routable(tracker):
    await register(tracker, node("node-a", shard(0, 3, entry=False)))
    cov = (await tracker.get(f"/v1/coverage/{MODEL}")).json()
    assert cov["covered_layers"] == 4 and cov["routable"] is False


async def test_route_has_two_hops_with_inclusive_layers(tracker):
    await register(tracker, node("node-a", shard(0, 1)))
    await register(tracker, node("node-b", shard(2, 3)))
    resp = await tracker.get("/v1/route", params={"model": MODEL})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"model": MODEL, "hops": [
        {"node_id": "node-a", "endpoint": "http://node-a.test:8000", "start_layer": 0, "end_layer": 1},
        {"node_id": "node-b", "endpoint": "http://node-b.test:8000", "start_layer": 2, "end_layer": 3}],
        "unverified": ["node-a", "node-b"],  # one holder per range: nothing can spot-check them
        "verified": False}  # each admitted on its own word (no challenge: the first holder of its range)
    resp = await tracker.get("/v1/route", params={"model": MODEL, "start_layer": 2, "end_layer": 3})
    assert [h["node_id"] for h in resp.json()["hops"]] == ["node-b"]


async def test_route_by_hf_repo_uses_the_preset_name(tracker):
    await register(tracker, node("node-a", shard(0, 3)))
    resp = await tracker.get("/v1/route", params={"model": "meshnet/tiny-llama"})
    assert resp.json()["model"] == MODEL
    assert resp.json()["hops"] == [{"node_id": "node-a", "endpoint": "http://node-a.test:8000",
                                    "start_layer": 0, "end_layer": 3}]


async def test_route_with_a_gap_is_503_model_loading(tracker):
    await register(tracker, node("node-a", shard(0, 1)))
    resp = await tracker.get("/v1/route", params={"model": MODEL})
    body = assert_envelope(resp, 503, "model_loading")
    assert resp.headers["Retry-After"] == "5"
    assert "layer 2 of 4" in body["error"]["message"]
    assert body["coverage"]["segments"] == [{"start_layer": 0, "end_layer": 1, "node_count": 1},
                                            {"start_layer": 2, "end_layer": 3, "node_count": 0}]
    assert body["coverage"]["routable"] is False


@pytest.mark.parametrize("params, status, code", [
    ({}, 422, "invalid_field"),
    ({"model": MODEL, "start_layer": "x"}, 422, "invalid_field"),
    ({"model": MODEL, "start_layer": 3, "end_layer": 1}, 422, "invalid_field"),
    ({"model": MODEL, "end_layer": 4}, 422, "invalid_field"),
    ({"model": "no-such-model"}, 404, "model_not_found"),
])
async def test_bad_route_queries(tracker, params, status, code):
    assert_envelope(await tracker.get("/v1/route", params=params), status, code)


async def test_negative_start_layer_is_422(asgi_client):
    app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:"), run_loop=False)
    client = await asgi_client(app, raise_app_exceptions=False)
    resp = await client.get("/v1/route", params={"model": MODEL, "start_layer": -1})
    assert_envelope(resp, 422, "invalid_field")


# ---- chat and demand --------------------------------------------------------------------------


async def test_chat_for_an_unroutable_model_is_503_and_counts_as_demand(tracker):
    before = {d["model"]: d for d in (await tracker.get("/v1/demand")).json()["demand"]}
    assert before[MODEL]["requests_per_min"] == 0.0
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        resp = await tracker.post("/v1/chat/completions", json=chat)
        body = assert_envelope(resp, 503, "model_loading")
        assert resp.headers["Retry-After"] == "5"
        assert body["error"]["message"] == "model tiny-llama is not routable yet: 0/4 layers covered by admitted nodes"
        assert body["coverage"]["covered_layers"] == 0
    after = {d["model"]: d for d in (await tracker.get("/v1/demand")).json()["demand"]}
    # two requests in the 300 s demand window: 2 * 60 / 300 per minute
    assert after[MODEL] == {"model": MODEL, "requests_per_min": 0.4, "routable": False}


async def test_bad_chat_body_is_400_before_any_routing(tracker):
    resp = await tracker.post("/v1/chat/completions", json={"model": MODEL, "messages": [], "temperature": 0})
    assert "'messages'" in assert_envelope(resp, 400, "invalid_field")["error"]["message"]
    demand = {d["model"]: d for d in (await tracker.get("/v1/demand")).json()["demand"]}
    assert demand[MODEL]["requests_per_min"] == 0.0


async def test_chat_for_an_unknown_model_is_404(tracker):
    resp = await tracker.post("/v1/chat/completions",
                              json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert_envelope(resp, 404, "model_not_found")


# ---- heartbeats and directives ------------------------------------------------------------------


async def test_heartbeat_for_an_unknown_node_is_404(tracker):
    resp = await tracker.post("/v1/nodes/node-ghost/heartbeat", json={"shards": [], "stats": {}})
    body = assert_envelope(resp, 404, "unknown_node")
    assert "re-registers" in body["error"]["hint"]


async def test_heartbeat_updates_shards_and_stats(tracker):
    await register(tracker, node("node-a"))
    resp = await tracker.post("/v1/nodes/node-a/heartbeat",
                              json={"shards": [shard(0, 3)], "stats": {"tokens_per_s": 42.0, "sessions": 1}})
    assert resp.status_code == 200 and resp.json() == {"directives": [], "reachable": True, "reach_error": "",
                                                       "heartbeat_interval_s": 10.0}
    (view,) = (await tracker.get("/v1/nodes")).json()["nodes"]
    assert view["stats"] == {"tokens_per_s": 42.0, "decode_latency_s": 0.0, "requests_per_min": 0.0,
                             "sessions": 1, "requests_running": 0, "requests_total": 0, "cache_bytes_left": 0,
                             "tokens_processed": 0, "rss_bytes": 0, "relay_rtt_s": 0.0}
    assert [(s["shard_start"], s["shard_end"], s["admitted"]) for s in view["shards"]] == [(0, 3, True)]
    assert (await tracker.get(f"/v1/coverage/{MODEL}")).json()["routable"] is True


async def test_directives_are_listed_then_delivered_by_heartbeat(tracker):
    await register(tracker, node("node-a", shard(0, 3)))
    await register(tracker, node("node-b"))
    assert (await tracker.get("/v1/directives")).json() == {"directives": []}
    resp = await tracker.post("/v1/operator/reload", json={"node_id": "node-a"})
    assert resp.status_code == 200
    queued = resp.json()["directive"]
    assert queued["type"] == "RELOAD" and queued["status"] == "queued" and queued["node_id"] == "node-a"
    listed = (await tracker.get("/v1/directives", params={"node_id": "node-a"})).json()["directives"]
    assert [(d["id"], d["type"], d["status"]) for d in listed] == [(queued["id"], "RELOAD", "queued")]
    assert (await tracker.get("/v1/directives", params={"node_id": "node-b"})).json()["directives"] == []
    delivered = (await tracker.post("/v1/nodes/node-a/heartbeat", json={"shards": []})).json()["directives"]
    assert [(d["id"], d["status"]) for d in delivered] == [(queued["id"], "delivered")]
    again = (await tracker.post("/v1/nodes/node-a/heartbeat", json={"shards": []})).json()["directives"]
    assert again == []
    resp = await tracker.post("/v1/nodes/node-a/heartbeat",
                              json={"directive_updates": [{"id": queued["id"], "status": "done"}]})
    assert resp.status_code == 200
    (final,) = (await tracker.get("/v1/directives")).json()["directives"]
    assert final["status"] == "done"


async def test_bad_directive_update_status_is_422(tracker):
    await register(tracker, node("node-a"))
    resp = await tracker.post("/v1/nodes/node-a/heartbeat",
                              json={"directive_updates": [{"id": 1, "status": "exploded"}]})
    assert "directive_updates.0.status" in assert_envelope(resp, 422, "invalid_field")["error"]["message"]


async def test_reload_makes_earlier_reports_stale_until_a_new_report(tracker):
    payload = node("node-a", shard(0, 3))
    await register(tracker, payload)
    assert (await tracker.get(f"/v1/coverage/{MODEL}")).json()["routable"] is True
    await tracker.post("/v1/operator/reload", json={"node_id": "node-a"})
    assert (await tracker.get(f"/v1/coverage/{MODEL}")).json()["routable"] is False
    nodes = (await tracker.get("/v1/nodes")).json()["nodes"]
    assert nodes[0]["shards"][0]["capability"]["stale"] is True
    fresh = [{**s, "report": {**s["report"], "timestamp": s["report"]["timestamp"] + 1}} for s in payload["shards"]]
    await tracker.post("/v1/nodes/node-a/heartbeat", json={"shards": fresh})
    assert (await tracker.get(f"/v1/coverage/{MODEL}")).json()["routable"] is True


async def test_pinning_a_new_shard_keeps_the_nodes_other_shards_admitted(tracker):
    await register(tracker, node("node-a", shard(0, 3)))
    resp = await tracker.post("/v1/operator/pin", json={"model": MODEL, "node_id": "node-a", "shard": "0-1"})
    assert resp.status_code == 200
    assert (await tracker.get(f"/v1/coverage/{MODEL}")).json()["routable"] is True


# ---- network assign ----------------------------------------------------------------------------


async def test_network_assign_shape_for_an_empty_network(tracker):
    resp = await tracker.get("/v1/network/assign", params={"hf_repo": "meshnet/tiny-llama", "vram_mb": 1024})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"hf_repo": "meshnet/tiny-llama", "model": MODEL, "shard_start": 0, "shard_end": 3,
                           "num_layers": 4, "gap_found": True, "price_per_token": 0.0}


async def test_network_assign_points_at_the_first_gap(tracker):
    await register(tracker, node("node-a", shard(0, 1)))
    body = (await tracker.get("/v1/network/assign", params={"hf_repo": MODEL})).json()
    assert (body["shard_start"], body["shard_end"], body["gap_found"]) == (2, 3, True)
    await register(tracker, node("node-b", shard(2, 3)))
    body = (await tracker.get("/v1/network/assign", params={"hf_repo": MODEL})).json()
    assert (body["shard_start"], body["shard_end"], body["gap_found"]) == (0, 3, False)


@pytest.mark.parametrize("params, status, code", [
    ({}, 422, "invalid_field"),
    ({"hf_repo": MODEL, "vram_mb": 0}, 422, "invalid_field"),
    ({"hf_repo": MODEL, "vram_mb": "lots"}, 422, "invalid_field"),
    ({"hf_repo": MODEL, "quantization": "fp8"}, 400, "invalid_request"),
    ({"hf_repo": "nobody/nothing"}, 404, "model_not_found"),
])
async def test_bad_network_assign_queries(tracker, params, status, code):
    assert_envelope(await tracker.get("/v1/network/assign", params=params), status, code)


# ---- operator auth, health, models, metrics ---------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/operator/pin", {"model": MODEL, "node_id": "node-a"}),
    ("/v1/operator/reload", {"node_id": "node-a"}),
    ("/v1/operator/doctor", {"node_id": "node-a"}),
    ("/v1/operator/drain", {"node_id": "node-a"}),
])
async def test_operator_endpoints_refuse_without_the_token(make_tracker, path, body):
    tracker = await make_tracker(operator_token="s3cret")
    await register(tracker, node("node-a", shard(0, 3)))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cre"},
                    {"Authorization": "Bearer s3crét".encode()}):  # non-ASCII: a 401 too, not a 500
        resp = await tracker.post(path, json=body, headers=headers)
        error = assert_envelope(resp, 401, "unauthorized")["error"]
        assert error["type"] == "authentication_error"
    assert (await tracker.get("/v1/directives")).json()["directives"] == []
    (view,) = (await tracker.get("/v1/nodes")).json()["nodes"]
    assert view["draining"] is False


async def test_an_operator_token_of_any_characters_is_accepted_as_utf_8(make_tracker):
    tracker = await make_tracker(operator_token="sécret")
    await register(tracker, node("node-a", shard(0, 3)))
    resp = await tracker.post("/v1/operator/drain", json={"node_id": "node-a"},
                              headers={"Authorization": "Bearer sécret".encode()})
    assert resp.status_code == 200


async def test_operator_drain_with_the_token(make_tracker):
    tracker = await make_tracker(operator_token="s3cret")
    await register(tracker, node("node-a", shard(0, 3)))
    resp = await tracker.post("/v1/operator/drain", json={"node_id": "node-a"},
                              headers={"Authorization": "Bearer s3cret"})
    assert resp.status_code == 200 and resp.json() == {"node_id": "node-a", "draining": True}
    cov = (await tracker.get(f"/v1/coverage/{MODEL}")).json()
    assert cov["covered_layers"] == 0 and cov["routable"] is False


async def test_operator_pin_queues_a_load(tracker):
    await register(tracker, node("node-a"))
    resp = await tracker.post("/v1/operator/pin", json={"model": MODEL, "node_id": "node-a", "shard": "0-1"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["pinned"] == {"node_id": "node-a", "model": MODEL, "shard_start": 0, "shard_end": 1}
    assert [(d["type"], d["shard_start"], d["shard_end"], d["tier"]) for d in body["directives"]] == [
        ("LOAD_SHARD", 0, 1, "pinned")]
    resp = await tracker.post("/v1/operator/pin", json={"model": MODEL, "node_id": "node-a", "shard": "2-9"})
    assert_envelope(resp, 422, "invalid_field")
    resp = await tracker.post("/v1/operator/pin", json={"model": MODEL, "node_id": "node-a", "shard": "two"})
    assert "'shard'" in assert_envelope(resp, 422, "invalid_field")["error"]["message"]


async def test_health_and_models(tracker):
    await register(tracker, node("node-a", shard(0, 3)))
    assert (await tracker.get("/v1/health")).json() == {"status": "ok", "draining": False, "nodes": 1,
                                                         "models": [MODEL], "leader": True}
    listed = (await tracker.get("/v1/models")).json()
    created = listed["data"][0].pop("created")
    assert isinstance(created, int) and abs(created - time.time()) < 3600
    assert listed == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "owned_by": "meshnet", "num_layers": 4, "routable": True,
         "aliases": ["meshnet/tiny-llama"]}]}
    one = (await tracker.get("/v1/models/meshnet/tiny-llama")).json()
    assert one["id"] == MODEL and one["created"] == created and one["routable"] is True
    assert_envelope(await tracker.get("/v1/models/nothing"), 404, "model_not_found")


async def test_metrics_have_meshnet_names(tracker):
    await register(tracker, node("node-a", shard(0, 1)))
    resp = await tracker.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    lines = resp.text.splitlines()
    assert "meshnet_nodes 1.0" in lines
    assert 'meshnet_covered_layers{model="tiny-llama"} 2.0' in lines


def report_failure(tracker, node_id: str, *, sender: str, body: bytes = b'{"reason": "timeout"}'):
    """``sender`` reports a hop failure of ``node_id``, signed with its key."""
    path = f"/v1/nodes/{node_id}/failure"
    return tracker.post(path, content=body, headers=signed(sender, "POST", path, body))


async def test_failure_report_is_recorded_only_with_the_ticket_that_named_the_node(tracker):
    await register(tracker, node("node-a", shard(0, 3)))
    await register(tracker, node("node-b", shard(0, 1)))  # an entry of the same model
    await register(tracker, node("node-c", shard(0, 1)))  # another one
    ticket = await route_ticket(tracker, "node-b", MODEL, 2, 3, "s1")
    refused = {"no ticket": b'{"reason": "timeout"}',
               "another entry's": json.dumps({"reason": "t", "ticket": await route_ticket(
                   tracker, "node-c", MODEL, 2, 3, "s2")}).encode(),
               "not naming node-a": json.dumps({"reason": "t", "ticket": tracker.service.tickets.issue(
                   session="s3", model=MODEL, entry="node-b", entry_key=public_key("node-b"),
                   hops=[Hop("node-c", "http://node-c.test:8000", LayerRange(0, 2))])}).encode()}
    for why, body in refused.items():
        resp = await report_failure(tracker, "node-a", sender="node-b", body=body)
        assert_envelope(resp, 403, "not_on_route"), why
    assert tracker.service.nodes["node-a"].last_failure_s is None  # none of those counted
    resp = await report_failure(tracker, "node-a", sender="node-b",
                                body=json.dumps({"reason": "timeout", "ticket": ticket}).encode())
    assert resp.status_code == 200 and resp.json() == {"ok": True}
    assert tracker.service.nodes["node-a"].last_failure_s is not None
    # an unknown node's failure: nothing to record
    assert_envelope(await report_failure(tracker, "node-x", sender="node-b"), 404, "unknown_node")


async def test_failure_report_with_a_bad_body_is_4xx(tracker):
    await register(tracker, node("node-a", shard(0, 3)))
    await register(tracker, node("node-b", shard(0, 1)))
    resp = await report_failure(tracker, "node-a", sender="node-b", body=b"not json")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"


async def test_pin_with_a_reversed_range_is_a_422_naming_the_shard(tracker):
    await register(tracker, node("node-a"))
    resp = await tracker.post("/v1/operator/pin", json={"model": MODEL, "node_id": "node-a", "shard": "3-1"})
    error = assert_envelope(resp, 422, "invalid_field")["error"]
    assert error["message"] == "invalid field 'shard': layer range '3-1': END must be >= START"


async def test_unknown_paths_and_methods_get_the_json_envelope(tracker):
    resp = await tracker.get("/nope")
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "not_found" and resp.json()["error"]["message"] == "no route /nope"
    resp = await tracker.get("/v1/chat/completions")
    assert resp.status_code == 405
    assert resp.json()["error"] == {"message": "GET is not allowed on /v1/chat/completions", "type": "invalid_request_error",
                                    "code": "method_not_allowed"}


# ---- heartbeat cadence (ADR-0037) -------------------------------------------------------------


def simulate_network(service, size: int) -> None:
    """Add ``size - len(nodes)`` copies of a registered node's record: a large network in memory."""
    from dataclasses import replace

    template = next(iter(service.nodes.values()))
    for k in range(size - len(service.nodes)):
        service.nodes[f"sim-{k:05d}"] = replace(template, node_id=f"sim-{k:05d}", shards=[])


async def test_heartbeats_announce_a_longer_interval_as_the_network_grows(tracker):
    await register(tracker, node("node-a"))
    small = await tracker.post("/v1/nodes/node-a/heartbeat", json={})
    assert small.json()["heartbeat_interval_s"] == 10.0
    simulate_network(tracker.service, 10_000)  # 10,000 nodes: 500 heartbeats/s at 20 s
    big = await tracker.post("/v1/nodes/node-a/heartbeat", json={})
    assert big.status_code == 200 and big.json()["heartbeat_interval_s"] == 20.0
    again = await tracker.post("/v1/nodes/register", json=node("node-b"))
    assert again.json()["heartbeat_interval_s"] == 10_001 / 500  # node-b is the 10,001st
    assert tracker.service.cadence().timeout_s == pytest.approx(2.5 * 10_001 / 500)


async def test_a_node_told_a_long_interval_is_not_dropped_when_the_network_shrinks(tracker):
    svc = tracker.service
    await register(tracker, node("node-a"))
    await register(tracker, node("node-b"))
    simulate_network(svc, 10_000)
    await tracker.post("/v1/nodes/node-a/heartbeat", json={})  # told 20 s: its timeout is 50 s
    for nid in [n for n in svc.nodes if n.startswith("sim-")]:
        del svc.nodes[nid]
    assert svc.cadence().timeout_s == 25.0  # a small network again
    beat = svc.nodes["node-a"].last_heartbeat_s
    svc.nodes["node-b"].last_heartbeat_s = beat
    assert svc.check_dropouts(now=beat + 40.0) == ["node-b"]  # told 10 s at registration: 25 s
    assert svc.check_dropouts(now=beat + 49.0) == []
    assert svc.check_dropouts(now=beat + 51.0) == ["node-a"]


async def test_finished_directives_are_pruned_after_retention_and_recent_ones_stay_listed(make_tracker):
    from meshnet.tracker.app import prune_directives
    from meshnet.tracker.store import NewDirective

    tracker = await make_tracker(directive_retention_s=3600.0)
    store = tracker.service.store
    old_done, old_open, new_done = store.add_directives([NewDirective("n1", "RELOAD")] * 3)
    store.set_status(old_done, "done")
    store.set_status(new_done, "failed", "load failed")
    store.db.execute("UPDATE directives SET updated_at = updated_at - 7200 WHERE id IN (?, ?)", (old_done, old_open))
    assert await prune_directives(tracker.service) == 1
    listed = (await tracker.get("/v1/directives")).json()["directives"]
    assert [(d["id"], d["status"]) for d in listed] == [(new_done, "failed"), (old_open, "queued")]
