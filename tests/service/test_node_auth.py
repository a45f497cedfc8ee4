"""Who may join and act as a node, through the tracker's HTTP API (ADR-0035): join tokens, node ids
bound to keys, signed heartbeats, who may report a failure, and the protocol revision."""

from __future__ import annotations

import asyncio
import json

import pytest

from meshnet.protocol.control import PROTOCOL_REVISION
from meshnet.tracker.app import build_app
from meshnet.tracker.service import TrackerSettings
from tests.fake_nodes import HealthyNodes
from tests.payloads import capability_report, public_key, registration, route_ticket, signed

MODEL = "tiny-llama"


def shard(start: int, end: int) -> dict:
    return {"model": MODEL, "shard_start": start, "shard_end": end, "entry": start == 0, "tier": "pinned",
            "report": capability_report(MODEL, start, end)}


@pytest.fixture
def make_tracker(asgi_client):
    """``make(**settings) -> client``; the client sends exactly what a test gives it (no auto-signing)."""
    async def make(**settings):
        settings = {"models": (MODEL,), "db_path": ":memory:", **settings}
        app = build_app(TrackerSettings(**settings), run_loop=False, transport=HealthyNodes())
        client = await asgi_client(app, "http://tracker")
        client.service = app.state.service
        return client
    return make


@pytest.fixture
async def tracker(make_tracker):
    return await make_tracker()


async def post(tracker, path: str, body: dict, *, as_node: str | None, salt: str = "", **headers):
    """POST ``body`` signed by ``as_node``'s fixed key (another ``salt``: another key), or unsigned."""
    raw = json.dumps(body).encode()
    sig = signed(as_node, "POST", path, raw, salt=salt) if as_node else {}
    return await tracker.post(path, content=raw, headers={**sig, **headers, "Content-Type": "application/json"})


async def register(tracker, node_id: str, *shards: dict, endpoint: str | None = None, salt: str = "", **headers):
    body = registration(node_id, endpoint or f"http://{node_id}.test:8000", shards=list(shards))
    if salt:
        body["public_key"] = public_key(node_id, salt=salt)
    return await post(tracker, "/v1/nodes/register", body, as_node=node_id, salt=salt, **headers)


def error(resp, status: int, code: str) -> str:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code, resp.text
    return resp.json()["error"]["message"]


async def endpoints(tracker) -> dict[str, str]:
    return {n["node_id"]: n["endpoint"] for n in (await tracker.get("/v1/nodes")).json()["nodes"]}


# ---- joining --------------------------------------------------------------------------------------


async def test_a_tracker_with_a_join_token_refuses_a_registration_without_it(make_tracker):
    tracker = await make_tracker(join_token="j0in")
    error(await register(tracker, "node-a"), 401, "join_token")
    error(await register(tracker, "node-a", **{"X-Meshnet-Join-Token": "guess"}), 401, "join_token")
    error(await register(tracker, "node-a", **{"X-Meshnet-Join-Token": "jöin".encode()}), 401, "join_token")
    assert await endpoints(tracker) == {}
    assert (await register(tracker, "node-a", **{"X-Meshnet-Join-Token": "j0in"})).status_code == 200


async def test_a_registration_must_be_signed_by_the_key_it_registers(tracker):
    body = registration("node-a", "http://node-a.test:8000")
    error(await post(tracker, "/v1/nodes/register", body, as_node=None), 401, "unsigned")
    # signed, but by a key other than the one in the body: no proof the sender holds that key
    error(await post(tracker, "/v1/nodes/register", body, as_node="node-a", salt="impostor"), 401, "bad_signature")
    assert await endpoints(tracker) == {}


async def test_a_stolen_node_id_is_409_and_the_original_record_stays(tracker):
    assert (await register(tracker, "node-1", shard(0, 3), endpoint="http://good.test:8000")).status_code == 200
    # an impostor: `meshnet node start --node-id node-1` with its own key
    resp = await register(tracker, "node-1", endpoint="http://evil.test:8000", salt="impostor")
    message = error(resp, 409, "node_id_taken")
    assert "node-1" in message and "another key" in message
    assert await endpoints(tracker) == {"node-1": "http://good.test:8000"}
    assert [s.layers.to_inclusive() for s in tracker.service.nodes["node-1"].shards] == [(0, 3)]
    assert (await tracker.get(f"/v1/coverage/{MODEL}")).json()["routable"] is True


async def test_the_same_key_registers_again_after_a_restart(tracker):
    assert (await register(tracker, "node-1", endpoint="http://one.test:8000")).status_code == 200
    resp = await register(tracker, "node-1", shard(0, 3), endpoint="http://moved.test:8000")
    assert resp.status_code == 200 and resp.json()["node_id"] == "node-1"
    assert await endpoints(tracker) == {"node-1": "http://moved.test:8000"}


async def test_the_binding_survives_a_tracker_restart(make_tracker, tmp_path):
    db = str(tmp_path / "tracker.db")
    first = await make_tracker(db_path=db)
    assert (await register(first, "node-1")).status_code == 200
    second = await make_tracker(db_path=db)  # a new tracker process on the same store
    error(await register(second, "node-1", salt="impostor"), 409, "node_id_taken")
    assert (await register(second, "node-1")).status_code == 200


@pytest.mark.parametrize("stated, shown", [(None, 1), (PROTOCOL_REVISION + 1, PROTOCOL_REVISION + 1)])
async def test_another_protocol_revision_is_refused_naming_both(tracker, stated, shown):
    body = registration("node-a", "http://node-a.test:8000")
    if stated is None:
        del body["protocol"]  # a node from before the field existed
    else:
        body["protocol"] = stated
    message = error(await post(tracker, "/v1/nodes/register", body, as_node="node-a"), 426, "protocol_mismatch")
    assert message == f"node speaks protocol revision {shown}, this tracker speaks revision {PROTOCOL_REVISION}"
    assert await endpoints(tracker) == {}


# ---- later calls ------------------------------------------------------------------------------------


HEARTBEAT = {"shards": [], "stats": {"sessions": 7}}


async def test_a_heartbeat_must_be_signed_by_the_nodes_key(tracker):
    await register(tracker, "node-a", shard(0, 3))
    path = "/v1/nodes/node-a/heartbeat"
    error(await post(tracker, path, HEARTBEAT, as_node=None), 401, "unsigned")
    error(await post(tracker, path, HEARTBEAT, as_node="node-a", salt="forger"), 401, "bad_signature")
    await register(tracker, "node-b")
    error(await post(tracker, path, HEARTBEAT, as_node="node-b"), 403, "not_your_node")
    node = tracker.service.nodes["node-a"]
    assert node.stats.sessions == 0 and len(node.shards) == 1  # none of those touched the record
    assert (await post(tracker, path, HEARTBEAT, as_node="node-a")).status_code == 200
    assert node.stats.sessions == 7


async def test_a_replayed_heartbeat_is_refused(tracker):
    await register(tracker, "node-a")
    path = "/v1/nodes/node-a/heartbeat"
    raw = json.dumps(HEARTBEAT).encode()
    headers = {**signed("node-a", "POST", path, raw), "Content-Type": "application/json"}
    assert (await tracker.post(path, content=raw, headers=headers)).status_code == 200
    error(await tracker.post(path, content=raw, headers=headers), 401, "replayed")


async def test_a_heartbeat_captured_before_a_tracker_restart_is_refused_after_it(asgi_client, tmp_path):
    """The nonces a tracker remembers are gone after a restart, but a node's calls are ordered by the
    time it signed them: once the node registered again, a captured older call is stale."""
    import time

    settings = TrackerSettings(models=(MODEL,), db_path=str(tmp_path / "tracker.db"))
    before = await asgi_client(build_app(settings, run_loop=False, transport=HealthyNodes()), "http://tracker")
    assert (await register(before, "node-a")).status_code == 200
    path = "/v1/nodes/node-a/heartbeat"
    raw = json.dumps(HEARTBEAT).encode()
    captured = {**signed("node-a", "POST", path, raw), "Content-Type": "application/json"}
    assert (await before.post(path, content=raw, headers=captured)).status_code == 200
    after = await asgi_client(build_app(settings, run_loop=False, transport=HealthyNodes()), "http://tracker")
    await asyncio.sleep(0.01)  # the node signs its next call later than the captured one
    assert (await register(after, "node-a")).status_code == 200  # the node comes back
    error(await after.post(path, content=raw, headers=captured), 409, "stale_call")


async def test_drain_and_deregister_are_the_nodes_own(tracker):
    await register(tracker, "node-a", shard(0, 3))
    await register(tracker, "node-b")
    error(await tracker.post("/v1/nodes/node-a/drain"), 401, "unsigned")
    error(await post(tracker, "/v1/nodes/node-a/drain", {}, as_node="node-b"), 403, "not_your_node")
    error(await tracker.delete("/v1/nodes/node-a", headers=signed("node-b", "DELETE", "/v1/nodes/node-a")),
          403, "not_your_node")
    assert tracker.service.nodes["node-a"].draining is False
    resp = await tracker.delete("/v1/nodes/node-a", headers=signed("node-a", "DELETE", "/v1/nodes/node-a"))
    assert resp.status_code == 200 and "node-a" not in tracker.service.nodes


# ---- failure reports ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sender, salt, status, code", [
    (None, "", 401, "unsigned"),                 # anyone on the network
    ("node-x", "", 401, "unknown_signer"),       # never registered
    ("node-entry", "forger", 401, "bad_signature"),  # a registered id with a key that is not its own
    ("node-hop", "", 403, "not_on_route"),       # the reported node itself
    ("node-tail", "", 403, "not_on_route"),      # registered, but drives no route (no entry shard)
])
async def test_a_failure_report_counts_only_from_a_node_that_routes_through_the_reported_one(
        tracker, sender, salt, status, code):
    await register(tracker, "node-entry", shard(0, 1))
    await register(tracker, "node-hop", shard(2, 3))
    await register(tracker, "node-tail", shard(2, 3))
    path = "/v1/nodes/node-hop/failure"
    # the ticket of a session whose route put node-hop on node-entry's route (ADR-0042 amendment)
    body = {"reason": "timeout", "ticket": await route_ticket(tracker, "node-entry", MODEL, 2, 3, "s1",
                                                              exclude=("node-tail",))}
    error(await post(tracker, path, body, as_node=sender, salt=salt), status, code)
    assert tracker.service.nodes["node-hop"].last_failure_s is None  # not pushed to last resort
    resp = await post(tracker, path, body, as_node="node-entry")
    assert resp.status_code == 200 and tracker.service.nodes["node-hop"].last_failure_s is not None


class AnsweringNodes(HealthyNodes):
    """``GET /v1/health`` answers as the node a host names in :attr:`answers` (as a live node does)."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: dict[str, str] = {}

    async def handle_async_request(self, request):
        import httpx

        if request.url.host in self.answers and request.url.path == "/v1/health":
            return httpx.Response(200, json={"status": "ok", "node_id": self.answers[request.url.host]})
        return await super().handle_async_request(request)


async def test_a_second_live_process_with_a_node_s_key_is_refused_and_a_moved_node_is_not(asgi_client):
    nodes = AnsweringNodes()
    app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:"), run_loop=False, transport=nodes)
    tracker = await asgi_client(app, "http://tracker")
    nodes.answers["first.test"] = "node-1"
    assert (await register(tracker, "node-1", shard(0, 3), endpoint="http://first.test:8000")).status_code == 200
    # a clone (same id, same key) elsewhere while the first still answers as node-1
    message = error(await register(tracker, "node-1", endpoint="http://clone.test:8000"), 409, "node_id_in_use")
    assert "runs already at http://first.test:8000" in message
    assert (await endpoints(tracker))["node-1"] == "http://first.test:8000"
    nodes.answers["first.test"] = "node-9"  # the old address now serves another node: node-1 moved
    assert (await register(tracker, "node-1", endpoint="http://moved.test:8000")).status_code == 200
    nodes.answers.pop("first.test")
    nodes.down.add("moved.test")  # and once its recorded endpoint is silent, it may move again
    assert (await register(tracker, "node-1", endpoint="http://again.test:8000")).status_code == 200
    assert (await endpoints(tracker))["node-1"] == "http://again.test:8000"
