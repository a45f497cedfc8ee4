"""The tracker's sqlite store (ADR-0037): batched directive writes, indexes, pruning."""

from __future__ import annotations

import sqlite3

from meshnet.tracker.store import NewDirective, TrackerStore


def new(node_id: str, k: int = 0) -> NewDirective:
    return NewDirective(node_id, "LOAD_SHARD", "tiny-llama", k, k + 1, "bootstrap", f"reason {k}")


def commits_during(store: TrackerStore, action) -> list[str]:
    """The transaction-ending statements sqlite ran during ``action`` (trace of the connection)."""
    seen: list[str] = []
    store.db.set_trace_callback(seen.append)
    try:
        action()
    finally:
        store.db.set_trace_callback(None)
    return [s for s in seen if s.strip().upper() in ("COMMIT", "ROLLBACK")]


def test_a_batch_of_directives_is_one_transaction():
    store = TrackerStore()
    batch = [new(f"n{k % 7}", k) for k in range(250)]
    before = store.db.total_changes
    ends = commits_during(store, lambda: store.add_directives(batch))
    assert ends == ["COMMIT"]
    assert store.db.total_changes - before == 250
    rows = store.directives(limit=1000)
    assert len(rows) == 250 and all(d.status == "queued" for d in rows)
    assert [(d.node_id, d.shard_start, d.reason) for d in reversed(rows)] == [
        (f"n{k % 7}", k, f"reason {k}") for k in range(250)]  # ids in the order given


def test_a_batch_returns_its_ids_in_order_and_an_empty_one_writes_nothing():
    store = TrackerStore()
    assert store.add_directives([]) == []
    ids = store.add_directives([new("a"), new("b")])
    assert [store.directive(i).node_id for i in ids] == ["a", "b"]


def test_a_failing_batch_is_rolled_back_whole():
    store = TrackerStore()
    bad = NewDirective("n1", None, None)  # type NOT NULL
    try:
        store.add_directives([new("n0"), bad])
    except sqlite3.IntegrityError:
        pass
    else:
        raise AssertionError("the NOT NULL constraint should fail")
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
    store = TrackerStore(path)
    names = {row["name"] for row in store.db.execute("PRAGMA index_list(directives)")}
    assert {"directives_by_node_status", "directives_by_status"} <= names
    columns = {name: [r["name"] for r in store.db.execute(f"PRAGMA index_info({name})")]
               for name in ("directives_by_node_status", "directives_by_status")}
    assert columns == {"directives_by_node_status": ["node_id", "status"],
                       "directives_by_status": ["status", "updated_at"]}


def test_a_heartbeats_read_uses_the_node_status_index():
    store = TrackerStore()
    plan = " ".join(r["detail"] for r in store.db.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM directives WHERE node_id = ? AND status IN ('queued')", ("n",)))
    assert "directives_by_node_status" in plan


def test_pruning_removes_finished_directives_past_retention_and_keeps_open_ones():
    store = TrackerStore()
    ids = store.add_directives([new(f"n{k}") for k in range(6)])
    statuses = ["queued", "delivered", "acked", "done", "failed", "done"]
    for i, status in zip(ids, statuses):
        store.set_status(i, status)
    now = 1_000_000.0
    ages_s = [100_000, 100_000, 100_000, 100_000, 100_000, 10]  # the last one finished recently
    for i, age in zip(ids, ages_s):
        store.db.execute("UPDATE directives SET updated_at = ? WHERE id = ?", (now - age, i))
    assert store.prune_finished(86_400, now=now) == 2
    left = {d.id: d.status for d in store.directives()}
    assert left == {ids[0]: "queued", ids[1]: "delivered", ids[2]: "acked", ids[5]: "done"}
    assert store.prune_finished(86_400, now=now) == 0


def test_fail_open_fails_only_that_nodes_open_directives():
    store = TrackerStore()
    a1, a2, b1 = store.add_directives([new("a"), new("a"), new("b")])
    store.set_status(a2, "done")
    assert store.fail_open("a", "node dropped out") == 1
    assert {d.id: (d.status, d.error) for d in store.directives()} == {
        a1: ("failed", "node dropped out"), a2: ("done", None), b1: ("queued", None)}


def test_directives_updated_after_a_time():
    store = TrackerStore()
    old, new_ = store.add_directives([new("a"), new("b")])
    store.db.execute("UPDATE directives SET updated_at = 100 WHERE id = ?", (old,))
    store.db.execute("UPDATE directives SET updated_at = 200 WHERE id = ?", (new_,))
    assert [d.id for d in store.directives(updated_after=150)] == [new_]
    assert [d.id for d in store.directives(updated_after=50)] == [new_, old]


def test_status_updates_are_one_transaction():
    store = TrackerStore()
    a, b, c, other = store.add_directives([new("a"), new("a"), new("a"), new("b")])
    ends = commits_during(store, lambda: store.set_statuses([(a, "done", None), (b, "failed", "no memory"),
                                                             (c, "delivered", None), (other, "done", None)],
                                                            node_id="a"))
    assert ends == ["COMMIT"]
    assert {d.id: (d.status, d.error) for d in store.directives()} == {
        a: ("done", None), b: ("failed", "no memory"), c: ("delivered", None),
        other: ("queued", None)}  # node a cannot finish node b's directive
    assert commits_during(store, lambda: store.set_statuses([], node_id="a")) == []
