"""The heartbeat cadence rule (ADR-0037): the interval grows with the network within a budget,
the dropout timeout follows it, and 30 s detection holds while the rate allows."""

from __future__ import annotations

import pytest

from meshnet.tracker.cadence import (MAX_DROPOUT_S, MAX_HEARTBEATS_PER_S, TARGET_HEARTBEATS_PER_S, Cadence,
                                     heartbeat_cadence)


@pytest.mark.parametrize(("nodes", "interval_s", "timeout_s", "expected"), [
    (0, 10.0, 25.0, Cadence(10.0, 25.0)),          # empty network: the configured values
    (1_000, 10.0, 25.0, Cadence(10.0, 25.0)),      # 100/s: within the 200/s budget
    (2_000, 10.0, 25.0, Cadence(10.0, 25.0)),      # exactly the budget
    (2_200, 10.0, 25.0, Cadence(11.0, 27.5)),      # the budget lengthens the interval
    (2_400, 10.0, 25.0, Cadence(12.0, 30.0)),      # the longest interval that keeps 30 s
    (4_000, 10.0, 25.0, Cadence(12.0, 30.0)),      # over budget (333/s) to keep 30 s
    (6_000, 10.0, 25.0, Cadence(12.0, 30.0)),      # at the 500/s ceiling
    (10_000, 10.0, 25.0, Cadence(20.0, 50.0)),     # beyond: 30 s no longer holds
    (100_000, 10.0, 25.0, Cadence(200.0, 500.0)),
    (100, 1.0, 3.0, Cadence(1.0, 3.0)),            # a local mesh's short settings stay
    (600, 1.0, 3.0, Cadence(3.0, 7.5)),
    (4_000, 15.0, 40.0, Cadence(15.0, 40.0)),      # a configured interval over 12 s is kept
    (100, 10.0, 60.0, Cadence(10.0, 60.0)),        # a longer configured timeout is kept
])
def test_heartbeat_cadence(nodes, interval_s, timeout_s, expected):
    assert heartbeat_cadence(nodes, interval_s, timeout_s) == expected


@pytest.mark.parametrize("nodes", [1, 10, 500, 2_000, 2_401, 5_000, 6_000, 6_001, 10_000, 50_000])
def test_rate_and_dropout_bounds(nodes):
    c = heartbeat_cadence(nodes, 10.0, 25.0)
    rate = nodes / c.interval_s
    assert rate <= MAX_HEARTBEATS_PER_S + 1e-9
    if nodes <= MAX_HEARTBEATS_PER_S * MAX_DROPOUT_S / 2.5:
        assert c.timeout_s <= MAX_DROPOUT_S
    if rate > TARGET_HEARTBEATS_PER_S + 1e-9:
        assert c.timeout_s == pytest.approx(max(MAX_DROPOUT_S, 2.5 * nodes / MAX_HEARTBEATS_PER_S))


def test_a_silent_node_of_a_10000_node_network_is_dropped_within_30_s_when_its_probe_fails():
    """ADR-0054: the heartbeat timeout at 10,000 nodes is 50 s, but a node silent past the dropout
    deadline is probed, and dropped at once when the probe fails; one that answers stays until
    its timeout (it may only be slow to heartbeat)."""
    from meshnet.tracker.registry import NodeRecord
    from meshnet.tracker.service import TrackerService, TrackerSettings

    svc = TrackerService(TrackerSettings(db_path=":memory:", probe_timeout_s=3.0))
    for k in range(10_000):
        svc.nodes[f"n{k:05d}"] = NodeRecord(f"n{k:05d}", f"http://n{k}.test:1", "", 2**30, 0, "cpu", ["bfloat16"],
                                            10.0, None, 1, True, reachable=True, last_heartbeat_s=0.0, probed_s=0.0)
    assert svc.cadence().timeout_s == 50.0 and svc.dropout_deadline_s() == 25.0
    for node in svc.nodes.values():  # every node heartbeats at t = 10 s, then two go silent
        node.last_heartbeat_s = 10.0
    alive = [n for n in svc.nodes.values() if n.node_id not in ("n00001", "n00002")]

    def heartbeat_all(t: float) -> None:
        for node in alive:
            node.last_heartbeat_s = t

    heartbeat_all(30.0)
    assert svc.to_probe(now=30.0) == [] and svc.check_dropouts(now=30.0) == []
    heartbeat_all(35.5)
    assert [n.node_id for n in svc.to_probe(now=35.5)] == ["n00001", "n00002"]  # 25.5 s silent: probe them
    svc.set_reachability("n00001", "http://n1.test:1", "GET http://n1.test:1/v1/health failed: ConnectError",
                         now=37.0)  # dead: its probe fails
    svc.set_reachability("n00002", "http://n2.test:1", "", now=37.0)  # alive, only slow to heartbeat
    heartbeat_all(38.0)
    assert svc.check_dropouts(now=38.0) == ["n00001"]  # 28 s after its last heartbeat
    assert [n.node_id for n in svc.to_probe(now=39.0)] == []  # n00002 answered since its last heartbeat
    heartbeat_all(60.5)
    assert svc.check_dropouts(now=60.5) == ["n00002"]  # its own 50 s timeout


def test_a_thousand_nodes_that_drop_out_at_once_cost_one_transaction_and_a_few_log_lines(caplog):
    """A rack or a region going silent: its nodes are forgotten together (their open directives
    failed in one store transaction, not one or two a node), and the log says how many."""
    from meshnet.tracker.registry import NodeRecord
    from meshnet.tracker.service import TrackerService, TrackerSettings
    from meshnet.tracker.store import NewDirective

    svc = TrackerService(TrackerSettings(db_path=":memory:"))
    for k in range(3_000):
        svc.nodes[f"n{k:05d}"] = NodeRecord(f"n{k:05d}", f"http://n{k}.test:1", "", 2**30, 0, "cpu", ["bfloat16"],
                                            10.0, None, 1, True, reachable=True, last_heartbeat_s=100.0)
    silent = [f"n{k:05d}" for k in range(0, 3_000, 3)]
    for node_id in silent:
        svc.nodes[node_id].last_heartbeat_s = 0.0
    svc.store.add_directives([NewDirective(n, "RELOAD") for n in ("n00000", "n00001", "n00003")])
    transactions = []
    svc.store.db.set_trace_callback(lambda sql: transactions.append(sql) if sql.strip().upper() == "COMMIT" else None)
    with caplog.at_level("WARNING", logger="meshnet.tracker.membership"):
        assert svc.check_dropouts(now=110.0) == silent
    svc.store.db.set_trace_callback(None)
    assert transactions == ["COMMIT"] and len(svc.nodes) == 2_000 and svc.dirty
    assert {d.node_id: d.status for d in svc.store.directives()} == {"n00000": "failed", "n00001": "queued",
                                                                     "n00003": "failed"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 21 and lines[0] == "node n00000 dropped out (no heartbeat for 110 s)"
    assert lines[-1] == "980 more nodes dropped out at once (no heartbeat for 110-110 s)"
