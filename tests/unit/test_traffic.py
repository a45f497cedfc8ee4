"""The traffic history and the entry node's traffic log (ADR-0046): buckets, summaries, merging."""

from __future__ import annotations

import pytest

from meshnet.gateway.pipeline import GenerationStats
from meshnet.gateway.traffic import TrafficLog
from meshnet.layers import LayerRange
from meshnet.node.metrics import NodeMetrics
from meshnet.protocol.route import Hop
from meshnet.protocol.traffic import BUCKET_COUNT, FailoverEvent, NodeTraffic, SessionInFlight, recent_summary
from meshnet.stats import BucketStat, TimeBuckets
from meshnet.tracker.traffic import merge_traffic


@pytest.mark.parametrize("t, index", [(0.0, 0), (9.999, 0), (10.0, 1), (125.0, 12), (-0.5, -1)])
def test_bucket_index_is_aligned_to_multiples_of_bucket_s(t, index):
    assert TimeBuckets(10.0, 6).index(t) == index


def test_buckets_fold_count_sum_and_max_per_series():
    b = TimeBuckets(10.0, 6)
    for value, t in [(0.2, 100.0), (0.4, 105.0), (0.9, 111.0)]:
        b.add("ttft_s", value, t)
    b.add("forward_tokens", 7, 101.0)
    assert b.stat("ttft_s", 10) == BucketStat(2, pytest.approx(0.6), 0.4)
    assert b.stat("ttft_s", 10).mean == pytest.approx(0.3)
    assert b.stat("ttft_s", 11) == BucketStat(1, 0.9, 0.9)
    assert b.stat("forward_tokens", 10).total == 7
    assert b.stat("tpot_s", 10).mean is None
    assert b.window(115.0) == [6, 7, 8, 9, 10, 11]


def test_old_buckets_are_dropped_and_late_samples_ignored():
    b = TimeBuckets(10.0, 3)
    b.add("x", 1, 0.0)
    b.add("x", 2, 15.0)
    b.add("x", 3, 35.0)  # bucket 3: buckets 0 goes (keeps 1, 2, 3)
    assert b.stat("x", 0).count == 0
    assert b.stat("x", 1).total == 2
    b.add("x", 9, 5.0)  # older than the kept window
    assert b.stat("x", 0).count == 0
    assert len(b._buckets) == 2


def test_copy_is_independent():
    b = TimeBuckets(10.0, 3)
    b.add("x", 1, 0.0)
    c = b.copy()
    c.add("x", 5, 1.0)
    assert (b.stat("x", 0).total, c.stat("x", 0).total) == (1, 6)


def test_bad_bucket_settings_raise():
    with pytest.raises(ValueError):
        TimeBuckets(0.0, 3)
    with pytest.raises(ValueError):
        TimeBuckets(10.0, 0)


def test_node_traffic_buckets_summarise_ttft_tpot_tokens_and_batch_sizes():
    metrics = NodeMetrics()
    now = [1000.0]
    metrics.clock = lambda: now[0]
    metrics.observe_forward(12, 0.05, 0)          # bucket 100
    metrics.first_token(0.25)
    now[0] = 1003.0
    metrics.first_token(0.35)
    metrics.generation_started()
    metrics.generation_finished(GenerationStats(prompt_tokens=12, completion_tokens=5, decode_s=0.2))  # 0.05 s/token
    now[0] = 1012.0
    metrics.observe_forward(1, 0.01, 12)         # bucket 101
    # batch sizes on the monotonic clock: monotonic 50 is wall 1012, so 41.5 -> 1003.5, 49 -> 1011
    sizes = [(41.5, 1), (41.6, 3), (49.0, 2)]
    rows = metrics.traffic_buckets(sizes, now_s=1012.0, monotonic_s=50.0)
    assert len(rows) == BUCKET_COUNT
    assert [r.start_s for r in rows[-2:]] == [1000.0, 1010.0]
    older, newest = rows[-2], rows[-1]
    assert (older.ttft_s, older.first_tokens, older.tpot_s, older.forward_tokens) == (0.3, 2, 0.05, 12)
    assert (older.batch_size, older.batch_size_max, older.forwards, older.finished) == (2.0, 3, 2, 1)
    assert (newest.ttft_s, newest.first_tokens, newest.tpot_s, newest.forward_tokens) == (None, 0, None, 1)
    assert (newest.batch_size, newest.batch_size_max) == (2.0, 2)
    assert rows[0].start_s == 1010.0 - 10.0 * (BUCKET_COUNT - 1)
    assert (rows[0].forward_tokens, rows[0].batch_size) == (0, None)
    assert metrics.traffic_buckets(sizes, now_s=1012.0, monotonic_s=50.0)[-2].batch_size == 2.0  # not folded twice


def _hop(node: str, start: int, end: int) -> Hop:
    return Hop(node, f"http://{node}.test", LayerRange(start, end))


def test_traffic_log_lists_live_sessions_with_their_current_route():
    now = [500.0]
    log = TrafficLog("entry", clock=lambda: now[0])
    route = [_hop("entry", 0, 10), _hop("b", 10, 20), _hop("c", 20, 30)]
    stats = GenerationStats(prompt_tokens=40)
    log.session_started("s1", "smollm2-135m", stats, lambda: list(route))
    now[0] = 502.5
    stats.completion_tokens, stats.first_token_s = 7, 0.31234
    route[1] = _hop("d", 10, 20)
    log.failover("s1", _hop("b", 10, 20), [_hop("d", 10, 20)], "hop b at http://b.test\n(layers 10-19) froze")
    assert log.sessions() == [SessionInFlight(
        session_id="s1", model="smollm2-135m", entry_node="entry",
        route=[{"node_id": "entry", "start_layer": 0, "end_layer": 9}, {"node_id": "d", "start_layer": 10,
                                                                        "end_layer": 19},
               {"node_id": "c", "start_layer": 20, "end_layer": 29}],
        prompt_tokens=40, completion_tokens=7, age_s=2.5, ttft_s=0.3123, failovers=1)]
    assert log.failovers() == [FailoverEvent(at_s=502.5, session_id="s1", entry_node="entry", failed_node="b",
                                             start_layer=10, end_layer=19, replacement=["d"],
                                             reason="hop b at http://b.test (layers 10-19) froze")]
    log.session_ended("s1")
    log.session_ended("never-started")
    assert (log.sessions(), len(log), len(log.failovers())) == ([], 0, 1)


def test_traffic_log_keeps_the_newest_failovers():
    log = TrafficLog("entry", clock=lambda: 1.0, max_failovers=2)
    for i in range(3):
        log.failover(f"s{i}", _hop("b", 1, 2), [_hop("c", 1, 2)], "x")
    assert [e.session_id for e in log.failovers()] == ["s2", "s1"]


def test_merge_traffic_orders_nodes_sessions_and_failovers():
    def session(sid: str, entry: str, age: float) -> SessionInFlight:
        return SessionInFlight(session_id=sid, model="m", entry_node=entry, route=[], prompt_tokens=1,
                               completion_tokens=0, age_s=age)

    def event(sid: str, at: float, entry: str) -> FailoverEvent:
        return FailoverEvent(at_s=at, session_id=sid, entry_node=entry, failed_node="x", start_layer=1,
                             end_layer=2, replacement=["y"])

    a = NodeTraffic(node_id="b-node", at_s=9.0, sessions=[session("s2", "b-node", 1.0)],
                    failovers=[event("s2", 5.0, "b-node"), event("s9", 3.0, "b-node")])
    b = NodeTraffic(node_id="a-node", at_s=9.0, sessions=[session("s1", "a-node", 4.0)],
                    failovers=[event("s1", 4.0, "a-node"), event("s9", 3.0, "b-node")])
    merged = merge_traffic([a, b], 9.0)
    assert [n.node_id for n in merged.nodes] == ["a-node", "b-node"]
    assert [s.session_id for s in merged.sessions] == ["s1", "s2"]
    assert [(e.session_id, e.at_s) for e in merged.failovers] == [("s2", 5.0), ("s1", 4.0), ("s9", 3.0)]
    assert all(n.sessions == [] and n.failovers == [] for n in merged.nodes)  # said once, mesh-wide


def _bucket(start: float, **fields) -> dict:
    return {"start_s": start, "ttft_s": None, "first_tokens": 0, "tpot_s": None, "finished": 0, "forward_tokens": 0,
            "batch_size": None, "batch_size_max": 0, "forwards": 0, **fields}


@pytest.mark.parametrize("last, expected", [
    (2, {"ttft_s": 0.4, "tpot_s": 0.05, "tokens_per_s": 3.0, "batch_size": 3.0, "batch_size_max": 4}),
    (3, {"ttft_s": 0.325, "tpot_s": 0.05, "tokens_per_s": 4.0, "batch_size": 2.0, "batch_size_max": 4}),
    (0, {"ttft_s": None, "tpot_s": None, "tokens_per_s": 0.0, "batch_size": None, "batch_size_max": 0}),
])
def test_recent_summary_weights_means_by_their_counts(last, expected):
    buckets = [_bucket(0.0, ttft_s=0.1, first_tokens=1, forward_tokens=60, batch_size=1.0, batch_size_max=1,
                       forwards=2),
               _bucket(10.0),
               _bucket(20.0, ttft_s=0.4, first_tokens=3, tpot_s=0.05, finished=2, forward_tokens=60,
                       batch_size=3.0, batch_size_max=4, forwards=2)]
    got = recent_summary(buckets, last)
    assert got == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in expected.items()}
