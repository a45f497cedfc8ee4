"""Two tracker services in-process on one PostgreSQL database (ADR-0043): one leads, the other
stands by; both answer registrations, heartbeats and reads from the shared state; the standby
takes over when the leader goes, and issues no directive twice.

The control loops are off (``run_loop=False``): the test drives each tracker's sync round
(:class:`meshnet.tracker.sharing.Sharing`) and the leader's rebalance itself, in a fixed order.
"""

from __future__ import annotations

import json

import pytest

from meshnet.tracker.app import build_app
from meshnet.tracker.rebalance import rebalance
from meshnet.tracker.service import TrackerSettings
from meshnet.tracker.sharing import Sharing
from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, registration

MODEL = "tiny-llama"  # 4 layers


def node(node_id: str, *shards: tuple[int, int]) -> dict:
    """A registration whose node holds ``shards`` (inclusive ranges) of the tiny model, admitted."""
    return registration(node_id, f"http://{node_id}.test:8000", vram_bytes=2 * 1024**3, max_loaded_shards=2,
                        shards=[{"model": MODEL, "shard_start": a, "shard_end": b, "entry": a == 0, "tier": "pinned",
                                 "quantization": "bfloat16", "report": capability_report(MODEL, a, b)}
                                for a, b in shards])


def heartbeat(shards: list[dict] | None = None, updates: list[dict] | None = None) -> dict:
    return {"shards": shards or [], "stats": {}, "directive_updates": updates or []}


@pytest.fixture
async def trackers(asgi_client, pg_url):
    """Two trackers (``a``, ``b``) on one fresh database, each with its :class:`Sharing`."""
    out = []
    for _ in range(2):
        app = build_app(TrackerSettings(models=(MODEL,), db_path=pg_url), run_loop=False, transport=HealthyNodes())
        client = await asgi_client(app, "http://tracker", auth=SignAsNodes())
        client.service = app.state.service
        client.sharing = Sharing(client.service, min_interval_s=0.0)
        out.append(client)
    return out


async def loads_of(client, node_id: str) -> list[tuple]:
    body = (await client.get("/v1/directives")).json()["directives"]
    return sorted((d["model"], d["shard_start"], d["shard_end"], d["status"]) for d in body
                  if d["node_id"] == node_id and d["type"] == "LOAD_SHARD")


async def test_one_leads_both_serve_and_the_standby_takes_over_without_duplicates(trackers):
    a, b = trackers
    assert await a.sharing.sync_round() is True
    assert await b.sharing.sync_round() is False
    assert ((await a.get("/v1/health")).json()["leader"], (await b.get("/v1/health")).json()["leader"]) == (True, False)

    # one ticket key for both (nodes verify tickets whichever tracker issued them)
    ra = await a.post("/v1/nodes/register", json=node("node-a", (0, 1)))
    rb = await b.post("/v1/nodes/register", json=node("node-b"))
    assert ra.status_code == rb.status_code == 200
    assert ra.json()["tracker_key"] == rb.json()["tracker_key"]

    # a refused chat at the standby is demand the leader counts; pins are shared
    chat = await b.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 503
    pinned = await b.post("/v1/operator/pin", json={"model": MODEL, "node_id": "node-b", "shard": "2-3"})
    assert pinned.status_code == 200, pinned.text
    await b.service.writes_done()  # the demand event is written off b's event loop; a reads it next round
    for t in (a, b):
        await t.sharing.sync_round()
    assert sorted(a.service.nodes) == sorted(b.service.nodes) == ["node-a", "node-b"]
    assert a.service.demand_rate(MODEL) == b.service.demand_rate(MODEL) == pytest.approx(60.0 / 300.0)
    assert a.service.store.pins() == b.service.store.pins()

    # the leader plans: node-b already has the pinned load 2-3 open, so nothing is issued twice
    assert await loads_of(a, "node-b") == [(MODEL, 2, 3, "queued")]
    rebalance(a.service)
    assert await loads_of(a, "node-b") == [(MODEL, 2, 3, "queued")]

    # node-b heartbeats to the standby and gets its load from the shared queue
    hb = await b.post("/v1/nodes/node-b/heartbeat", json=heartbeat())
    assert [(d["type"], d["shard_start"], d["shard_end"]) for d in hb.json()["directives"]] == [("LOAD_SHARD", 2, 3)]

    # the leader goes (its lock's connection closes, as when the process is killed)
    a.service.store.resign()
    a.service.store.lead = lambda: False  # ... and it does not come back
    assert await b.sharing.sync_round() is True
    assert b.service.dirty is True and sorted(b.service.nodes) == ["node-a", "node-b"]
    rebalance(b.service)  # the new leader plans over the same open directives
    assert await loads_of(b, "node-b") == [(MODEL, 2, 3, "delivered")]
    assert b.service.demand_rate(MODEL) == pytest.approx(60.0 / 300.0)

    # node-b finishes the load at the new leader: its shard and the finished directive are written together
    (load,) = [d for d in b.service.store.directives(node_id="node-b") if d.type == "LOAD_SHARD"]
    shard = node("x", (2, 3))["shards"][0]
    done = await b.post("/v1/nodes/node-b/heartbeat", json=heartbeat([shard], [{"id": load.id, "status": "done"}]))
    assert done.status_code == 200
    (row,) = [r for r in b.service.store.nodes_changed(0) if r.node_id == "node-b"]
    assert [(s["shard_start"], s["shard_end"]) for s in json.loads(row.record)["shards"]] == [(2, 3)]
    rebalance(b.service)
    assert await loads_of(b, "node-b") == [(MODEL, 2, 3, "done")]
    assert b.service.coverage(MODEL).covered_layers == 4


async def test_a_standby_does_not_fail_the_directives_of_a_node_that_heartbeats_elsewhere(trackers):
    a, b = trackers
    await a.sharing.sync_round()
    await b.sharing.sync_round()
    assert (await b.post("/v1/nodes/register", json=node("node-b"))).status_code == 200
    await a.sharing.sync_round()
    pin = await a.post("/v1/operator/pin", json={"model": MODEL, "node_id": "node-b", "shard": "0-3"})
    assert pin.status_code == 200
    # node-b heartbeats to the leader only; the standby has not heard from it for a long time
    assert (await a.post("/v1/nodes/node-b/heartbeat", json=heartbeat())).status_code == 200
    await a.sharing.sync_round()  # writes the heartbeat time
    b.service.nodes["node-b"].last_heartbeat_s -= 3600
    assert b.service.check_dropouts() == []  # the shared heartbeat time says it is alive
    for t in (a, b):  # then the node falls silent everywhere
        t.service.nodes["node-b"].last_heartbeat_s -= 3600
    a.service.store._exec("UPDATE nodes SET heartbeat_at = 0")
    assert b.service.check_dropouts() == ["node-b"]  # the standby forgets it ...
    assert [d.status for d in b.service.store.directives(node_id="node-b")] == ["delivered"]  # ... and fails nothing
    assert a.service.check_dropouts() == ["node-b"]  # the leader decides
    assert [d.status for d in a.service.store.directives(node_id="node-b")] == ["failed"]
    assert a.service.store.heartbeat_times(["node-b"]) == {}


async def test_the_control_loops_dropout_check_waits_on_the_database_off_the_loop(trackers):
    """ADR-0059: the leader's dropout check reads the shared heartbeat times and fails the dropped
    nodes' directives on worker threads; the loop serves meanwhile, and a node heard from while the
    times were read is not dropped."""
    import asyncio
    import threading
    import time

    a, _ = trackers
    await a.sharing.sync_round()
    for name in ("n1", "n2"):
        assert (await a.post("/v1/nodes/register", json=node(name))).status_code == 200
        assert (await a.post("/v1/operator/reload", json={"node_id": name})).status_code == 200
        a.service.nodes[name].last_heartbeat_s -= 3600
    await a.service.writes_done()
    a.service.store._exec("UPDATE nodes SET heartbeat_at = 0")  # silent everywhere
    loop_thread, reads = threading.get_ident(), []
    read, forget = a.service.store.heartbeat_times, a.service.store.forget_nodes

    def slow_read(node_ids):
        reads.append(threading.get_ident())
        time.sleep(0.3)
        return read(node_ids)

    def slow_forget(*args, **kwargs):
        reads.append(threading.get_ident())
        time.sleep(0.3)
        return forget(*args, **kwargs)

    a.service.store.heartbeat_times, a.service.store.forget_nodes = slow_read, slow_forget
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
            if reads and a.service.nodes.get("n2") is not None:
                a.service.nodes["n2"].last_heartbeat_s = time.monotonic()  # n2 is heard from meanwhile

    task = asyncio.create_task(ticker())
    try:
        assert await a.service.check_dropouts_off_loop() == ["n1"]
    finally:
        task.cancel()
    assert len(reads) == 2 and loop_thread not in reads
    assert ticks >= 20  # the loop ran all along (0.6 s of store calls, a tick each 10 ms)
    assert [d.status for d in a.service.store.directives(node_id="n1")] == ["failed"]
    assert [d.status for d in a.service.store.directives(node_id="n2")] == ["queued"]
    assert sorted(a.service.nodes) == ["n2"]


async def test_a_probe_of_a_node_silent_past_its_timeout_writes_no_record_that_would_bring_it_back(trackers):
    """A leader frozen for a while resumes with a node in its registry that its successor has dropped
    and deleted; that node's failed probe must not write its record again (the successor would read it
    back and list a dead node until its own timeout). Seen in a clean-clone CI run of
    tests/integration/test_frozen_tracker.py once the dropout check awaited the store."""
    import time

    a, b = trackers
    await a.sharing.sync_round()
    await b.sharing.sync_round()
    assert (await a.post("/v1/nodes/register", json=node("n1", (0, 3)))).status_code == 200
    await a.service.writes_done()
    await b.sharing.sync_round()
    assert "n1" in b.service.nodes
    b.service.store._exec("DELETE FROM nodes WHERE node_id = 'n1'")  # the successor dropped it meanwhile
    endpoint = a.service.nodes["n1"].endpoint
    a.service.set_reachability("n1", endpoint, "")
    a.service.nodes["n1"].last_heartbeat_s = time.monotonic() - 3600  # silent for an hour
    a.service.set_reachability("n1", endpoint, "GET /v1/health failed: ConnectError")
    await a.service.writes_done()
    assert a.service.store.nodes_changed(0) == [] and not a.service.nodes["n1"].reachable


async def test_a_directive_queued_at_one_tracker_reaches_a_node_at_the_other_after_one_round(trackers):
    a, b = trackers
    await a.sharing.sync_round()
    assert (await b.post("/v1/nodes/register", json=node("node-c"))).status_code == 200
    await a.sharing.sync_round()
    assert (await a.post("/v1/operator/reload", json={"node_id": "node-c"})).status_code == 200
    first = await b.post("/v1/nodes/node-c/heartbeat", json=heartbeat())
    assert first.json()["directives"] == []  # b has not read the queue since: no query per idle heartbeat
    await b.sharing.sync_round()
    second = await b.post("/v1/nodes/node-c/heartbeat", json=heartbeat())
    assert [d["type"] for d in second.json()["directives"]] == ["RELOAD"]
    third = await b.post("/v1/nodes/node-c/heartbeat", json=heartbeat())
    assert third.json()["directives"] == []


async def test_rounds_come_at_most_once_per_interval():
    from meshnet.tracker.service import TrackerService

    svc = TrackerService(TrackerSettings(models=(MODEL,)))
    calls = []
    lead = svc.store.lead
    svc.store.lead = lambda: calls.append(1) or lead()
    sharing = Sharing(svc, min_interval_s=60.0)
    assert [await sharing.sync_round() for _ in range(5)] == [True] * 5
    assert calls == [1]  # a storm of wake-ups is one round


async def test_a_call_that_waited_in_a_frozen_tracker_cannot_undo_what_the_node_did_since(trackers):
    """ADR-0054: calls are ordered by the node's signed time. A registration the node sent to a
    tracker that then froze (the node moved on to the other) reaches it late: refused, whether
    the late tracker has heard of the node or not, and the record written since stays."""
    import time

    from tests.payloads import signed
    a, b = trackers
    sent_to_a = time.time() - 10.0  # the registration that waited in a's socket
    body = json.dumps(node("n1")).encode()  # no shards yet: the node joined model-less
    newer = await b.post("/v1/nodes/register", json=node("n1", (0, 3)))  # it moved on to b and loaded since
    assert newer.status_code == 200, newer.text
    def stored_sent_at() -> float:
        return b.service.store._rows("SELECT sent_at FROM nodes WHERE node_id = 'n1'")[0]["sent_at"]

    stored = stored_sent_at()
    assert stored > sent_to_a

    late = await a.post("/v1/nodes/register", content=body, headers={
        "content-type": "application/json", **signed("n1", "POST", "/v1/nodes/register", body, now=sent_to_a)})
    assert late.status_code == 409 and late.json()["error"]["code"] == "stale_call", late.text
    assert "n1" not in a.service.nodes  # nothing kept in memory either
    assert stored_sent_at() == stored
    await a.sharing.sync_round()
    assert [(s.model, s.layers.to_inclusive()) for s in a.service.nodes["n1"].shards] == [(MODEL, (0, 3))]

    # a heartbeat signed before the registration b applied: refused by b from memory, nothing changed
    beat = json.dumps(heartbeat()).encode()
    old_beat = await b.post("/v1/nodes/n1/heartbeat", content=beat, headers={
        "content-type": "application/json",
        **signed("n1", "POST", "/v1/nodes/n1/heartbeat", beat, now=sent_to_a)})
    assert old_beat.status_code == 409 and old_beat.json()["error"]["code"] == "stale_call"
    assert len(b.service.nodes["n1"].shards) == 1
    # the node's own next heartbeat goes through
    assert (await b.post("/v1/nodes/n1/heartbeat", json=heartbeat(node("n1", (0, 3))["shards"]))).status_code == 200


async def test_after_the_database_was_unreachable_no_node_is_dropped_until_its_heartbeats_could_be_shared(trackers,
                                                                                                        monkeypatch):
    """ADR-0054: heartbeats other trackers heard during an outage are not in the store, so a
    tracker drops nobody until one timeout after its first sync round that worked again."""
    import time

    a, b = trackers
    assert (await b.post("/v1/nodes/register", json=node("n1", (0, 3)))).status_code == 200
    await a.sharing.sync_round()
    a.service.nodes["n1"].last_heartbeat_s = time.monotonic() - 3600  # nobody heard it for an hour
    a.service.store._exec("UPDATE nodes SET heartbeat_at = ?", (time.time() - 3600,))
    exchange = a.sharing._exchange
    monkeypatch.setattr(a.sharing, "_exchange", lambda *args: (_ for _ in ()).throw(OSError("no route to host")))
    with pytest.raises(OSError):
        await a.sharing.sync_round()
    assert a.service.check_dropouts() == []  # blind while the store is gone
    monkeypatch.setattr(a.sharing, "_exchange", exchange)
    await a.sharing.sync_round()
    timeout_s = a.service.cadence().timeout_s
    assert a.service.blind_until - time.monotonic() == pytest.approx(timeout_s, abs=1.0)
    assert a.service.check_dropouts() == []
    assert a.service.check_dropouts(now=a.service.blind_until + 1.0) == ["n1"]  # then as before


async def test_a_hop_failure_heard_by_one_tracker_is_avoided_by_the_other_within_a_round(trackers):
    """ADR-0054: recent hop failures are shared through the store, so a successor (or any other
    tracker) routes around the failed node for the rest of its cooldown too."""
    import time

    a, b = trackers
    assert (await a.post("/v1/nodes/register", json=node("n1", (0, 3)))).status_code == 200
    await b.sharing.sync_round()
    assert b.service.nodes["n1"].last_failure_s is None
    a.service.report_failure("n1", "connection reset (reported by an entry)")
    await a.sharing.sync_round()  # a does not read back its own report
    await b.sharing.sync_round()
    assert time.monotonic() - b.service.nodes["n1"].last_failure_s < 5.0
    assert b.service.hop_failures_seen == 1
    seen = b.service.nodes["n1"].last_failure_s
    await b.sharing.sync_round()  # read once
    assert b.service.nodes["n1"].last_failure_s == seen


async def test_another_key_signed_before_the_node_s_latest_call_is_refused_as_an_impostor(trackers):
    """Only the node's own calls are ordered by its clock: a registration under another key is
    refused for its key (409 node_id_taken), whatever time it was signed at (ADR-0035, ADR-0054)."""
    import time

    from tests.payloads import public_key, signed
    a, _ = trackers
    assert (await a.post("/v1/nodes/register", json=node("n1", (0, 3)))).status_code == 200
    body = json.dumps({**node("n1"), "public_key": public_key("n1", salt="impostor")}).encode()
    headers = {"content-type": "application/json",
               **signed("n1", "POST", "/v1/nodes/register", body, salt="impostor", now=time.time() - 5.0)}
    refused = await a.post("/v1/nodes/register", content=body, headers=headers)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "node_id_taken", refused.text


async def test_a_tracker_reading_every_record_serves_others_between_batches(trackers, monkeypatch):
    """A tracker that starts (or takes over) applies every shared record; it does so a batch at a
    time with the event loop free in between, so heartbeats wait one batch, not all of them."""
    import asyncio

    import meshnet.tracker.sharing as sharing_module

    a, b = trackers
    await a.sharing.sync_round()
    for k in range(5):
        assert (await a.post("/v1/nodes/register", json=node(f"node-{k}"))).status_code == 200
    monkeypatch.setattr(sharing_module, "APPLY_BATCH", 2)
    batches, ticks = [], []
    apply = b.service.apply_rows
    b.service.apply_rows = lambda rows: batches.append((len(rows), len(ticks))) or apply(rows)

    async def other_work():  # what the loop also runs: it must get turns during the round
        for _ in range(1_000_000):  # bounded; cancelled once the round is over
            ticks.append(1)
            await asyncio.sleep(0)

    worker = asyncio.create_task(other_work())
    await b.sharing.sync_round()
    worker.cancel()
    assert [size for size, _ in batches] == [2, 2, 1]
    assert batches[0][1] < batches[1][1] < batches[2][1]  # the other task ran between every two batches
    assert sorted(b.service.nodes) == [f"node-{k}" for k in range(5)]
