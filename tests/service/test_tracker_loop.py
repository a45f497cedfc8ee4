"""The tracker's event loop never waits on its database (issue 29): a node call whose store work
stalls (a database that stopped answering) leaves the loop free to answer everything else, and
finishes once the store answers.

Each test stalls one store method on a gate. Were the call made on the event loop, the loop would
sit in the gate until its 10 s timeout and ``/v1/health`` could not answer while the node call is
pending: the tests assert that it does (an order of events, not a time).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from meshnet.tracker.app import build_app
from meshnet.tracker.service import TrackerSettings
from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, registration

MODEL = "tiny-llama"  # 4 layers
HEARTBEAT = {"shards": [], "stats": {"sessions": 3}, "directive_updates": []}
#: the longest a stalled store call waits for the test to release it, seconds
GATE_S = 10.0


@pytest.fixture
def make_tracker(asgi_client, tmp_path):
    """``make() -> client`` of a tracker on one sqlite file (a second call: the same file, a restart)."""
    async def make():
        settings = TrackerSettings(models=(MODEL,), db_path=str(tmp_path / "tracker.db"))
        app = build_app(settings, run_loop=False, transport=HealthyNodes())
        client = await asgi_client(app, "http://tracker", auth=SignAsNodes())
        client.service = app.state.service
        return client
    return make


def node(node_id: str) -> dict:
    shard = {"model": MODEL, "shard_start": 0, "shard_end": 3, "entry": True, "tier": "pinned",
             "report": capability_report(MODEL, 0, 3)}
    return registration(node_id, f"http://{node_id}.test:8000", shards=[shard])


class Gate:
    """Replaces ``store.<name>`` with a call that waits for :meth:`release` (at most
    :data:`GATE_S`) before doing what it did; ``entered`` is set when a call arrives."""

    def __init__(self, store, name: str, monkeypatch) -> None:
        self.entered, self._open = threading.Event(), threading.Event()
        real = getattr(store, name)

        def stalled(*args, **kwargs):
            self.entered.set()
            self._open.wait(GATE_S)
            return real(*args, **kwargs)

        monkeypatch.setattr(store, name, stalled)

    def release(self) -> None:
        self._open.set()


async def answered_meanwhile(tracker, gate: Gate, call) -> object:
    """Start ``call`` (a coroutine), wait until it reaches the stalled store, check that the tracker
    answers a health read while it waits there, then release the store; returns ``call``'s response."""
    pending = asyncio.create_task(call)
    assert await asyncio.to_thread(gate.entered.wait, GATE_S)
    health = await tracker.get("/v1/health")
    assert health.status_code == 200
    assert not pending.done()  # the node call still waits on the store: the loop was free meanwhile
    gate.release()
    return await pending


async def test_a_heartbeat_that_waits_on_the_store_leaves_the_loop_free(make_tracker, monkeypatch):
    tracker = await make_tracker()
    assert (await tracker.post("/v1/nodes/register", json=node("node-a"))).status_code == 200
    reload = await tracker.post("/v1/operator/reload", json={"node_id": "node-a"})
    assert reload.status_code == 200, reload.text
    gate = Gate(tracker.service.store, "set_statuses", monkeypatch)
    response = await answered_meanwhile(tracker, gate, tracker.post("/v1/nodes/node-a/heartbeat", json=HEARTBEAT))
    assert response.status_code == 200, response.text
    assert [d["type"] for d in response.json()["directives"]] == ["RELOAD"]
    assert tracker.service.nodes["node-a"].stats.sessions == 3


async def test_a_heartbeat_with_nothing_queued_makes_no_store_call(make_tracker, monkeypatch):
    tracker = await make_tracker()
    assert (await tracker.post("/v1/nodes/register", json=node("node-a"))).status_code == 200
    calls = []
    for name in ("directives", "set_statuses", "node_key"):
        monkeypatch.setattr(tracker.service.store, name, lambda *a, _n=name, **k: calls.append(_n))
    response = await tracker.post("/v1/nodes/node-a/heartbeat", json=HEARTBEAT)
    assert (response.status_code, response.json()["directives"], calls) == (200, [], [])


async def test_a_registration_that_waits_on_the_store_leaves_the_loop_free(make_tracker, monkeypatch):
    tracker = await make_tracker()
    gate = Gate(tracker.service.store, "bind_keys", monkeypatch)
    response = await answered_meanwhile(tracker, gate, tracker.post("/v1/nodes/register", json=node("node-a")))
    assert response.status_code == 200, response.text
    assert sorted(tracker.service.nodes) == ["node-a"]


async def test_a_key_read_from_the_store_leaves_the_loop_free(make_tracker, monkeypatch):
    first = await make_tracker()
    assert (await first.post("/v1/nodes/register", json=node("node-a"))).status_code == 200
    tracker = await make_tracker()  # a restart on the same file: the key is in the store, not in memory
    gate = Gate(tracker.service.store, "node_key", monkeypatch)
    response = await answered_meanwhile(tracker, gate, tracker.get("/v1/nodes/node-a/key"))
    assert response.status_code == 200, response.text
    assert response.json()["public_key"] == node("node-a")["public_key"]
