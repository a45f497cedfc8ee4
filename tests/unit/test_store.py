"""The tracker's store on both backends (ADR-0037, ADR-0043): batched directive writes, indexes,
pruning, one open load per node and range, shared node records and demand, the ticket key, the
quarantines (ADR-0042)."""

from __future__ import annotations

import sqlite3

import pytest

from meshnet.tracker.store import NewDirective, NodeRow, SqliteStore
from meshnet.tracker.tables import DemandEvent


@pytest.fixture(params=["sqlite", "postgres"])
def store(request):
    """An empty store on each backend (PostgreSQL: a fresh database, see tests/conftest.py)."""
    if request.param == "sqlite":
        s = SqliteStore()
    else:
        from meshnet.tracker.pgstore import PostgresStore
        s = PostgresStore(request.getfixturevalue("pg_url"))
    yield s
    s.close()


def new(node_id: str, k: int = 0) -> NewDirective:
    return NewDirective(node_id, "LOAD_SHARD", "tiny-llama", k, k + 1, "bootstrap", f"reason {k}")


def commits_during(store: SqliteStore, action) -> list[str]:
    """The transaction-ending statements sqlite ran during ``action`` (trace of the connection)."""
    seen: list[str] = []
    store.db.set_trace_callback(seen.append)
    try:
        action()
    finally:
        store.db.set_trace_callback(None)
    return [s for s in seen if s.strip().upper() in ("COMMIT", "ROLLBACK")]


def test_a_batch_of_directives_is_one_transaction():
    store = SqliteStore()
    batch = [new(f"n{k % 7}", k) for k in range(250)]
    before = store.db.total_changes
    ends = commits_during(store, lambda: store.add_directives(batch))
    assert ends == ["COMMIT"]
    assert store.db.total_changes - before == 250
    rows = store.directives(limit=1000)
    assert len(rows) == 250 and all(d.status == "queued" for d in rows)
    assert [(d.node_id, d.shard_start, d.reason) for d in reversed(rows)] == [
        (f"n{k % 7}", k, f"reason {k}") for k in range(250)]  # ids in the order given


def test_a_batch_returns_its_ids_in_order_and_an_empty_one_writes_nothing(store):
    assert store.add_directives([]) == []
    ids = store.add_directives([new("a"), new("b")])
    assert [store.directive(i).node_id for i in ids] == ["a", "b"]


def test_a_batch_keeps_any_text_and_missing_fields_as_given(store):
    odd = NewDirective("n-\u00fc", "DROP_SHARD", None, None, None, None, 'quote " comma , brace } \\ newline\n\u2192')
    ids = store.add_directives([odd, new("a", 3)])
    got = store.directive(ids[0])
    assert (got.node_id, got.type, got.model, got.shard_start, got.shard_end, got.tier, got.reason) == \
        ("n-\u00fc", "DROP_SHARD", None, None, None, None, 'quote " comma , brace } \\ newline\n\u2192')
    assert (store.directive(ids[1]).shard_start, store.directive(ids[1]).shard_end) == (3, 4)


def test_a_batch_over_several_statements_skips_an_open_twin_and_keeps_the_order(store, monkeypatch):
    import meshnet.tracker.store as store_module

    monkeypatch.setattr(store_module, "INSERT_CHUNK", 2)  # sqlite: three statements for five directives
    first = store.add_directives([new("a", 0)])
    ids = store.add_directives([new("b", 0), new("a", 0), new("c", 0), new("b", 0), new("d", 0)])
    assert ids[1] is None and ids[3] is None  # the open twin of a queued one, and of one in this batch
    assert [store.directive(i).node_id for i in (ids[0], ids[2], ids[4])] == ["b", "c", "d"]
    assert ids[0] < ids[2] < ids[4] and first[0] < ids[0]
    assert len(store.directives(limit=100)) == 4


def test_a_batch_without_conflicts_over_several_statements_gives_each_directive_its_own_id(store, monkeypatch):
    import meshnet.tracker.store as store_module

    monkeypatch.setattr(store_module, "INSERT_CHUNK", 2)  # sqlite: three statements for five directives
    store.add_directives([new("z", 9)])  # ids do not start at 1
    batch = [new(node, start) for node, start in (("b", 0), ("c", 1), ("d", 2), ("e", 3), ("f", 4))]
    ids = store.add_directives(batch)
    assert [(store.directive(i).node_id, store.directive(i).shard_start) for i in ids] == \
        [("b", 0), ("c", 1), ("d", 2), ("e", 3), ("f", 4)]
    assert ids == sorted(ids) and len(set(ids)) == 5


def test_a_failing_batch_is_rolled_back_whole(store):
    bad = NewDirective("n1", None, None)  # type NOT NULL
    with pytest.raises(store.IntegrityError):
        store.add_directives([new("n0"), bad])
    assert store.directives() == []
    store.add_directives([new("n0")])  # the connection is usable afterwards
    assert len(store.directives()) == 1


def test_the_indexes_exist_also_in_a_database_made_before_them(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript("CREATE TABLE directives (id INTEGER PRIMARY KEY AUTOINCREMENT, node_id TEXT NOT NULL, "
                      "type TEXT NOT NULL, model TEXT, shard_start INTEGER, shard_end INTEGER, tier TEXT, "
                      "status TEXT NOT NULL, error TEXT, reason TEXT, created_at REAL NOT NULL, "
                      "updated_at REAL NOT NULL);")
    old.close()
    store = SqliteStore(path)
    names = {row["name"] for row in store.db.execute("PRAGMA index_list(directives)")}
    assert {"directives_by_node_status", "directives_by_status"} <= names
    columns = {name: [r["name"] for r in store.db.execute(f"PRAGMA index_info({name})")]
               for name in ("directives_by_node_status", "directives_by_status")}
    assert columns == {"directives_by_node_status": ["node_id", "status"],
                       "directives_by_status": ["status", "updated_at"]}


def test_a_heartbeats_read_uses_the_node_status_index():
    store = SqliteStore()
    plan = " ".join(r["detail"] for r in store.db.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM directives WHERE node_id = ? AND status IN ('queued')", ("n",)))
    assert "directives_by_node_status" in plan


def test_pruning_removes_finished_directives_past_retention_and_keeps_open_ones(store):
    ids = store.add_directives([new(f"n{k}") for k in range(6)])
    statuses = ["queued", "delivered", "acked", "done", "failed", "done"]
    for i, status in zip(ids, statuses):
        store.set_status(i, status)
    now = 1_000_000.0
    ages_s = [100_000, 100_000, 100_000, 100_000, 100_000, 10]  # the last one finished recently
    for i, age in zip(ids, ages_s):
        store._exec("UPDATE directives SET updated_at = ? WHERE id = ?", (now - age, i))
    assert store.prune_finished(86_400, now=now) == 2
    left = {d.id: d.status for d in store.directives()}
    assert left == {ids[0]: "queued", ids[1]: "delivered", ids[2]: "acked", ids[5]: "done"}
    assert store.prune_finished(86_400, now=now) == 0


def test_fail_open_fails_only_that_nodes_open_directives(store):
    a1, a2, b1 = store.add_directives([new("a"), new("a", 1), new("b")])
    store.set_status(a2, "done")
    assert store.fail_open("a", "node dropped out") == 1
    assert {d.id: (d.status, d.error) for d in store.directives()} == {
        a1: ("failed", "node dropped out"), a2: ("done", None), b1: ("queued", None)}


@pytest.mark.parametrize("delete_records", [True, False])
def test_nodes_that_dropped_out_together_are_forgotten_in_one_transaction(store, monkeypatch, delete_records):
    import meshnet.tracker.store as store_module

    monkeypatch.setattr(store_module, "FORGET_CHUNK", 2)  # three statements of each kind for five nodes
    ids = store.add_directives([new(n) for n in ("a", "b", "c", "d", "e", "keep")])
    store.set_status(ids[1], "done")
    for n in ("a", "b", "c", "d", "e", "keep"):
        store.save_node(NodeRow(n, '{"v": 1}', record_at=10.0, heartbeat_at=10.0))
    failed = []
    forget = lambda: failed.append(store.forget_nodes(["a", "b", "c", "d", "e"], "node dropped out",  # noqa: E731
                                                      delete_records=delete_records))
    if isinstance(store, SqliteStore):
        assert commits_during(store, forget) == ["COMMIT"]
    else:
        forget()
    assert failed == [4]  # b's was done already
    assert {d.node_id: (d.status, d.error) for d in store.directives()} == {
        "a": ("failed", "node dropped out"), "b": ("done", None), "c": ("failed", "node dropped out"),
        "d": ("failed", "node dropped out"), "e": ("failed", "node dropped out"), "keep": ("queued", None)}
    assert sorted(r.node_id for r in store.nodes_changed(0.0)) == (
        ["keep"] if delete_records else ["a", "b", "c", "d", "e", "keep"])
    assert store.forget_nodes([], "nothing", delete_records=True) == 0


def test_directives_updated_after_a_time(store):
    old, new_ = store.add_directives([new("a"), new("b")])
    store._exec("UPDATE directives SET updated_at = 100 WHERE id = ?", (old,))
    store._exec("UPDATE directives SET updated_at = 200 WHERE id = ?", (new_,))
    assert [d.id for d in store.directives(updated_after=150)] == [new_]
    assert [d.id for d in store.directives(updated_after=50)] == [new_, old]


def test_status_updates_are_one_transaction():
    store = SqliteStore()
    a, b, c, other = store.add_directives([new("a"), new("a", 1), new("a", 2), new("b")])
    ends = commits_during(store, lambda: store.set_statuses([(a, "done", None), (b, "failed", "no memory"),
                                                             (c, "delivered", None), (other, "done", None)],
                                                            node_id="a"))
    assert ends == ["COMMIT"]
    assert {d.id: (d.status, d.error) for d in store.directives()} == {
        a: ("done", None), b: ("failed", "no memory"), c: ("delivered", None),
        other: ("queued", None)}  # node a cannot finish node b's directive
    assert commits_during(store, lambda: store.set_statuses([], node_id="a")) == []


def test_an_open_load_is_queued_once_per_node_model_and_range(store):
    first = store.add_directives([new("a"), new("a"), new("a", 1), new("b")])
    assert first[1] is None and None not in (first[0], first[2], first[3])
    assert store.add_directives([new("a")]) == [None]  # another tracker, or the next leader, asks again
    again = store.add_directive("a", "LOAD_SHARD", model="tiny-llama", shard_start=0, shard_end=1, tier="pinned")
    assert (again.id, again.tier, again.status) == (first[0], "bootstrap", "queued")  # the open one
    assert len(store.directives(node_id="a")) == 2
    store.set_status(first[0], "done")
    assert store.add_directives([new("a")])[0] is not None  # once finished, the same load may come again
    reloads = [store.add_directive("a", "RELOAD").id for _ in range(2)]
    assert len(set(reloads)) == 2  # only loads and drops are unique


def test_pins_replace_and_remove(store):
    store.add_pin("a", "m", 0, 3)
    store.add_pin("a", "m", 0, 5)
    assert [(p["node_id"], p["model"], p["shard_start"], p["shard_end"]) for p in store.pins()] == [("a", "m", 0, 5)]
    assert store.remove_pin("a", "m") is True and store.remove_pin("a", "m") is False
    assert store.pins("a") == []


def test_keys_and_models_first_one_wins(store):
    assert store.bind_key("a", "k1") == "k1"
    assert store.bind_key("a", "k2") == "k1"
    assert store.node_key("a") == "k1" and store.node_key("b") is None
    store.add_model("m")
    store.add_model("m", source="demand")
    store.add_model("d", source="demand")
    assert store.model_sources() == {"m": "operator", "d": "demand"}
    assert sorted(store.models()) == ["d", "m"]


def test_node_records_heartbeats_and_a_status_update_in_one_transaction(store):
    store.save_node(NodeRow("a", '{"v": 1}', record_at=100.0, heartbeat_at=100.0))
    store.save_node(NodeRow("b", '{"v": 2}', record_at=200.0, heartbeat_at=200.0))
    store.touch_nodes({"a": 150.0, "b": 120.0, "gone": 1.0})  # an older time never wins
    assert store.heartbeat_times(["a", "b", "c"]) == {"a": 150.0, "b": 200.0}
    assert [r.node_id for r in store.nodes_changed(150.0)] == ["b"]
    (d,) = store.add_directives([new("a")])
    store.set_statuses([(d, "done", None)], node_id="a", node=NodeRow("a", '{"v": 3}', 300.0, 300.0))
    assert store.directive(d).status == "done"
    assert store.nodes_changed(250.0) == [NodeRow("a", '{"v": 3}', 300.0, 300.0)]
    store.forget_nodes(["a"], "node dropped out", delete_records=True)
    assert store.heartbeat_times(["a", "b"]) == {"b": 200.0}


def test_a_node_record_from_an_earlier_call_or_written_earlier_for_the_same_call_loses(store):
    """Ordered by the node's signed call time, then (one call: a registration and its probe's
    verdict, written from two worker threads) by the time the tracker made the record."""
    assert store.save_node(NodeRow("a", '{"v": 1}', record_at=10.0, heartbeat_at=10.0, sent_at=5.0))
    assert not store.save_node(NodeRow("a", '{"v": 0}', record_at=9.0, heartbeat_at=9.0, sent_at=5.0))
    assert not store.save_node(NodeRow("a", '{"v": 0}', record_at=20.0, heartbeat_at=20.0, sent_at=4.0))
    assert store.nodes_changed(0.0) == [NodeRow("a", '{"v": 1}', 10.0, 10.0, 5.0)]
    assert store.save_node(NodeRow("a", '{"v": 2}', record_at=11.0, heartbeat_at=11.0, sent_at=5.0))
    assert store.save_node(NodeRow("a", '{"v": 3}', record_at=1.0, heartbeat_at=1.0, sent_at=6.0))
    assert store.nodes_changed(0.0) == [NodeRow("a", '{"v": 3}', 1.0, 1.0, 6.0)]


def test_demand_events_by_id_time_and_origin(store):
    ids = [store.add_demand_event(DemandEvent("m", kind, at, origin))
           for kind, at, origin in [("refused", 10.0, "t1"), ("served", 20.0, "t2"), ("refused", 30.0, "t1")]]
    assert ids == sorted(ids)
    assert [(e.kind, e.at) for e in store.demand_events(not_from="t2")] == [("refused", 10.0), ("refused", 30.0)]
    assert [e.at for e in store.demand_events(after_id=ids[0])] == [20.0, 30.0]
    assert [e.at for e in store.demand_events(since=15.0)] == [20.0, 30.0]
    assert store.prune_demand(25.0) == 2
    assert [e.id for e in store.demand_events()] == [ids[2]]


def test_quarantines_first_evidence_wins_until_lifted(store):
    assert store.quarantines() == {}
    assert store.add_quarantine("a", '{"reported_by": "e1"}', 100.0) == '{"reported_by": "e1"}'
    assert store.add_quarantine("a", '{"reported_by": "e2"}', 200.0) == '{"reported_by": "e1"}'
    store.add_quarantine("b", '{"reported_by": "e2"}', 50.0)
    assert list(store.quarantines().items()) == [("b", '{"reported_by": "e2"}'), ("a", '{"reported_by": "e1"}')]
    assert store.remove_quarantine("a") is True and store.remove_quarantine("a") is False
    assert store.quarantines() == {"b": '{"reported_by": "e2"}'}


def test_the_first_known_digest_stays(store):
    assert store.known_digest('["m", 0, 3]') is None
    assert store.learn_digest('["m", 0, 3]', "d1") == "d1"
    assert store.learn_digest('["m", 0, 3]', "d2") == "d1"
    assert store.known_digest('["m", 0, 3]') == "d1" and store.known_digest('["m", 3, 6]') is None


def test_a_trusted_digest_replaces_the_known_one_and_trusted_nodes_are_kept(store):
    """ADR-0069: a node the operator trusts sets its range's digest whatever was heard first."""
    store.learn_digest('["m", 0, 3]', "forged")
    store.anchor_digest('["m", 0, 3]', "real")
    assert store.known_digest('["m", 0, 3]') == "real" and store.learn_digest('["m", 0, 3]', "d3") == "real"
    assert store.trusted_nodes() == set()
    assert store.trust_node("a", True) is True and store.trust_node("a", True) is False
    store.trust_node("b", True)
    assert store.trust_node("a", False) is True and store.trust_node("a", False) is False
    assert store.trusted_nodes() == {"b"}


def test_a_sqlite_store_always_leads():
    assert SqliteStore().lead() is True


def test_an_older_database_with_duplicate_open_loads_keeps_the_oldest(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript("CREATE TABLE directives (id INTEGER PRIMARY KEY AUTOINCREMENT, node_id TEXT NOT NULL, "
                      "type TEXT NOT NULL, model TEXT, shard_start INTEGER, shard_end INTEGER, tier TEXT, "
                      "status TEXT NOT NULL, error TEXT, reason TEXT, created_at REAL NOT NULL, "
                      "updated_at REAL NOT NULL);"
                      "INSERT INTO directives VALUES (1, 'a', 'LOAD_SHARD', 'm', 0, 1, 'bootstrap', 'queued', "
                      "NULL, '', 1, 1), (2, 'a', 'LOAD_SHARD', 'm', 0, 1, 'bootstrap', 'delivered', NULL, '', 2, 2);")
    old.commit()
    old.close()
    store = SqliteStore(path)
    assert {d.id: (d.status, d.error) for d in store.directives()} == {
        1: ("queued", None), 2: ("failed", "duplicate open directive")}


def test_trackers_of_one_postgres_database_share_the_ticket_key_and_one_leads(pg_url):
    from meshnet.tracker.pgstore import PostgresStore
    from meshnet.protocol.signing import encode_public_key
    first, second = PostgresStore(pg_url), PostgresStore(pg_url)
    try:
        assert encode_public_key(first.tracker_key().public_key()) == encode_public_key(
            second.tracker_key().public_key())
        assert first.lead() is True
        assert second.lead() is False and first.lead() is True
        first.resign()
        assert second.lead() is True and first.lead() is False
    finally:
        first.close()
        second.close()


def test_a_leader_killed_inside_its_write_leaves_no_directive_and_the_next_writes_them_once(pg_url):
    import psycopg

    from meshnet.tracker.pgstore import PostgresStore
    old, new_leader = PostgresStore(pg_url), PostgresStore(pg_url)
    try:
        batch = [new(f"n{k % 3}", k) for k in range(30)]
        old.db.execute("BEGIN")  # the old leader's batch, not committed yet ...
        old.db.execute("INSERT INTO directives (node_id, type, model, shard_start, shard_end, tier, status, "
                       "created_at, updated_at) VALUES ('n0', 'LOAD_SHARD', 'tiny-llama', 0, 1, 'bootstrap', "
                       "'queued', 1, 1)")
        pid = old.db.info.backend_pid
        new_leader._exec("SELECT pg_terminate_backend(?)", (pid,))  # ... when its process dies
        assert new_leader.directives() == []
        ids = new_leader.add_directives(batch)
        assert None not in ids and len(new_leader.directives(limit=100)) == 30
        assert new_leader.add_directives(batch) == [None] * 30  # the same plan again queues nothing
        with pytest.raises(psycopg.OperationalError):
            old.db.execute("COMMIT")
    finally:
        new_leader.close()
        try:
            old.close()
        except Exception:  # noqa: BLE001 - its connection is gone
            pass


def _expire_lease(store) -> None:
    """End the lease now on the database's clock (as if its holder had been frozen past it)."""
    store._exec("UPDATE tracker_lease SET expires_at = clock_timestamp() - interval '1 second' WHERE id = 1")


def test_the_lease_passes_to_a_standby_only_once_expired_and_the_old_terms_writes_are_refused(pg_url):
    from meshnet.tracker.pgstore import PostgresStore
    from meshnet.tracker.store import LeaseLost
    old, standby = PostgresStore(pg_url), PostgresStore(pg_url)
    try:
        assert old.lead() is True and old.term == 1 and old.lease_valid()
        assert old.lead() is True and old.term == 1  # a renewal keeps the term
        assert standby.lead() is False and standby.term is None  # valid lease: nobody takes it
        assert old.add_directives([new("n0", 0)], term=1) == [1]

        _expire_lease(old)  # the leader froze past its lease
        assert standby.lead() is True and standby.term == 2
        # the old leader wakes up and writes with the term it planned under: refused whole
        with pytest.raises(LeaseLost, match="term 1 refused: the lease is at term 2"):
            old.add_directives([new("n1", 1), new("n2", 2)], term=1)
        with pytest.raises(LeaseLost):
            old.fail_open("n0", "node dropped out", term=1)
        with pytest.raises(LeaseLost):
            old.forget_nodes(["n0"], "node dropped out", delete_records=True, term=1)
        assert old.term is None and not old.lease_valid()
        assert [(d.id, d.node_id, d.status) for d in standby.directives()] == [(1, "n0", "queued")]
        assert old.lead() is False
        # the successor's own writes go through with its term (the refused batch drew no id)
        assert standby.add_directives([new("n1", 1)], term=2) == [2]
        assert standby.fail_open("n0", "node dropped out", term=2) == 1
    finally:
        old.close()
        standby.close()


def test_a_leader_that_resigns_hands_over_at_once_and_one_that_loses_its_renewal_stops(pg_url, monkeypatch, caplog):
    from meshnet.tracker import pgstore
    first, second = pgstore.PostgresStore(pg_url), pgstore.PostgresStore(pg_url)
    try:
        assert first.lead() is True
        first.resign()
        assert second.lead() is True and second.term == 2  # no waiting out the lease
        # the leader's own clock ends its leadership, whatever the database says
        monkeypatch.setattr(pgstore.time, "monotonic", lambda real=pgstore.time.monotonic: real() + pgstore.LEASE_S)
        assert second.lease_valid() is False
        monkeypatch.undo()
        # a renewal that fails (the database went away) ends leadership at once
        assert second.lead() is True and second.lease_valid()
        second._lease_db.close()
        monkeypatch.setattr(pgstore, "connect", lambda url: (_ for _ in ()).throw(
            pgstore.MeshnetError("cannot connect", code="database_unreachable", status=503)))
        with caplog.at_level("WARNING", logger="meshnet.tracker.pgstore"):
            assert second.lead() is False
        assert second.term is None and not second.lease_valid()
        assert "cannot renew the lease (term 2)" in caplog.text
    finally:
        first.close()
        second.close()


def test_every_connection_carries_the_statement_and_network_deadlines(pg_url):
    from meshnet.tracker.pgstore import PostgresStore
    store = PostgresStore(pg_url)
    try:
        assert store._rows("SHOW statement_timeout") == [{"statement_timeout": "10s"}]
        assert store.db.info.get_parameters()["tcp_user_timeout"] == "5000"
    finally:
        store.close()


def test_a_store_call_waits_for_a_stuck_one_at_most_the_lock_deadline():
    import threading
    import time

    from meshnet.errors import MeshnetError
    from meshnet.tracker.store import DeadlineLock
    store = SqliteStore()
    store.lock = DeadlineLock(wait_s=0.2)
    held, release = threading.Event(), threading.Event()

    def stuck_call():  # a worker thread's call waiting on an unreachable database
        with store.lock:
            held.set()
            release.wait(5)

    worker = threading.Thread(target=stuck_call)
    worker.start()
    assert held.wait(5)
    started = time.monotonic()
    with pytest.raises(MeshnetError, match="has not answered another call for 0 s") as err:
        store.models()
    assert err.value.code == "database_unreachable" and err.value.status == 503
    assert time.monotonic() - started < 2.0
    release.set()
    worker.join(5)
    assert store.models() == []


def test_a_group_commit_of_registrations_writes_each_as_alone_would(store):
    """``bind_keys``, ``save_nodes`` and ``pins_of`` (ADR-0063): several calls in one transaction,
    each with the result it would have had alone, in order (of two keys for one new id the first
    binds it; of two records of one node the later call wins)."""
    assert store.bind_key("old", "key-old") == "key-old"
    assert store.bind_keys([("a", "key-a"), ("old", "key-x"), ("a", "key-y"), ("b", "key-b")]) == \
        ["key-a", "key-old", "key-a", "key-b"]
    assert (store.node_key("a"), store.node_key("b")) == ("key-a", "key-b")
    rows = [NodeRow("a", '{"v": 1}', 10.0, 10.0, sent_at=5.0), NodeRow("a", '{"v": 0}', 9.0, 9.0, sent_at=4.0),
            NodeRow("b", '{"v": 2}', 10.0, 10.0, sent_at=5.0)]
    assert store.save_nodes(rows) == [True, False, True]
    assert store.nodes_changed(0.0) == [rows[0], rows[2]]
    store.add_pin("a", "tiny-llama", 0, 1)
    store.add_pin("a", "other", None, None)
    found = store.pins_of(["a", "b", "c"])
    assert list(found) == ["a"] and [p["model"] for p in found["a"]] == ["tiny-llama", "other"]
    assert (store.bind_keys([]), store.save_nodes([]), store.pins_of([])) == ([], [], {})
