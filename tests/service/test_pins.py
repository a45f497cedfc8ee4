"""Pins are operator intent, read back: a restarted node (and a restarted tracker) gives the
pinned shard back as ``pinned``; only unpin or a new pin changes that."""

from __future__ import annotations

import pytest

from meshnet.layers import LayerRange
from meshnet.tracker.app import build_app
from meshnet.tracker.rebalance import rebalance
from meshnet.protocol.control import RegisterRequest
from meshnet.tracker.service import TrackerService, TrackerSettings
from tests.payloads import SignAsNodes, registration

MODEL = "tiny-llama"


def bare_node(node_id: str = "pn") -> RegisterRequest:
    """A model-less node (no shard flags), as `meshnet node start --tracker URL --node-id pn` registers."""
    return RegisterRequest.model_validate(registration(node_id, f"http://{node_id}.test:8000", vram_bytes=2 * 1024**3))


def loads(svc: TrackerService, node_id: str = "pn") -> list[tuple]:
    return [(d.type, d.model, d.shard_start, d.shard_end, d.tier, d.status)
            for d in reversed(svc.store.directives(node_id=node_id))]


def finish_open_directives(svc: TrackerService, node_id: str = "pn") -> None:
    for d in svc.store.directives(node_id=node_id, statuses=("queued", "delivered")):
        svc.store.set_status(d.id, "done")


def test_restarted_node_gets_its_pinned_shard_back_as_pinned(tmp_path):
    svc = TrackerService(TrackerSettings(models=(MODEL,), db_path=str(tmp_path / "t.db")))
    svc.register(bare_node())
    pinned, queued = svc.pin("pn", MODEL, LayerRange.from_inclusive(0, 3))
    assert pinned == {"node_id": "pn", "model": MODEL, "shard_start": 0, "shard_end": 3}
    assert [(d.type, d.tier) for d in queued] == [("LOAD_SHARD", "pinned")]
    finish_open_directives(svc)

    svc.register(bare_node())  # the node restarts with the same --node-id and no shard flags
    assert loads(svc)[-1] == ("LOAD_SHARD", MODEL, 0, 3, "pinned", "queued")
    plan = rebalance(svc)  # the open pinned load counts as the node's assignment: no bootstrap range
    assert [(n, a.tier) for n, a in plan.loads if n == "pn"] == []
    assert [d for d in loads(svc) if d[4] == "bootstrap"] == []

    svc.register(bare_node())  # registering again while that load is open queues nothing twice
    assert sum(1 for d in loads(svc) if d[5] == "queued") == 1


def test_pin_survives_a_tracker_restart(tmp_path):
    db = str(tmp_path / "t.db")
    first = TrackerService(TrackerSettings(models=(MODEL,), db_path=db))
    first.register(bare_node())
    first.pin("pn", MODEL, LayerRange.from_inclusive(0, 3))
    first.store.db.close()

    second = TrackerService(TrackerSettings(models=(MODEL,), db_path=db))
    finish_open_directives(second)
    second.register(bare_node())
    assert loads(second)[-1] == ("LOAD_SHARD", MODEL, 0, 3, "pinned", "queued")


def test_unpin_stops_the_restore_and_a_new_pin_replaces_the_old(tmp_path):
    svc = TrackerService(TrackerSettings(models=(MODEL,), db_path=str(tmp_path / "t.db")))
    svc.register(bare_node())
    svc.pin("pn", MODEL, LayerRange.from_inclusive(0, 3))
    svc.pin("pn", MODEL, LayerRange.from_inclusive(2, 3))
    assert [(p["shard_start"], p["shard_end"]) for p in svc.store.pins("pn")] == [(2, 3)]
    finish_open_directives(svc)
    assert svc.unpin("pn", MODEL) is True
    assert svc.unpin("pn", MODEL) is False
    svc.register(bare_node())
    assert [d for d in loads(svc) if d[5] == "queued"] == []


@pytest.fixture
async def tracker(asgi_client):
    app = build_app(TrackerSettings(models=(MODEL,), db_path=":memory:"), run_loop=False)
    return await asgi_client(app, "http://tracker", auth=SignAsNodes())


async def test_unpin_endpoint(tracker):
    resp = await tracker.post("/v1/nodes/register", json=bare_node().model_dump())
    assert resp.status_code == 200, resp.text
    assert (await tracker.post("/v1/operator/pin", json={"model": MODEL, "node_id": "pn", "shard": "0-3"})).status_code == 200
    resp = await tracker.post("/v1/operator/unpin", json={"model": MODEL, "node_id": "pn"})
    assert resp.status_code == 200 and resp.json() == {"unpinned": {"node_id": "pn", "model": MODEL}}
    resp = await tracker.post("/v1/operator/unpin", json={"model": MODEL, "node_id": "pn"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "pin_not_found"
    resp = await tracker.post("/v1/operator/unpin", json={"node_id": "pn"})
    assert resp.status_code == 422 and "model" in resp.json()["error"]["message"]
