"""Node records as trackers of one database share them (ADR-0043)."""

from __future__ import annotations

from meshnet.layers import LayerRange
from meshnet.protocol.control import CapabilityReport, NodeStats
from meshnet.tracker.registry import NodeRecord, ShardRecord, record_from_json, record_to_json
from tests.payloads import capability_report


def test_a_record_comes_back_with_every_shared_field_and_the_readers_own_clock():
    report = CapabilityReport.model_validate(capability_report("tiny-llama", 0, 1))
    node = NodeRecord("n1", "http://n1.test:8000", "w", 2 * 1024**3, 1024, "cpu", ["int8"], 12.5, "tiny-llama", 2,
                      True, shards=[ShardRecord("tiny-llama", LayerRange(0, 2), "managed", "int8", True, 123, report)],
                      stats=NodeStats(tokens_per_s=7.5, sessions=3), stale_reports={report.timestamp},
                      last_failure_s=5.0, last_move_s=6.0, draining=True, reachable=True, reach_error="",
                      interval_s=12.0, record_at=1234.5)
    back = record_from_json(record_to_json(node), last_heartbeat_s=99.0)
    for name in ("node_id", "endpoint", "wallet", "vram_bytes", "ram_bytes", "device", "quantizations",
                 "benchmark_tokens_per_sec", "benchmark_model", "max_loaded_shards", "accepts_placement",
                 "registered_at", "draining", "reachable", "reach_error", "interval_s", "record_at", "shards",
                 "stats", "stale_reports"):
        assert getattr(back, name) == getattr(node, name), name
    assert back.last_heartbeat_s == 99.0
    assert (back.last_failure_s, back.last_move_s) == (None, None)  # kept by each tracker, not shared
    assert back.admitted(back.shards[0]) is False  # drained and its report stale, as on the writer


def test_quarantines_written_by_another_tracker_are_applied_each_round():
    """A tracker applies the store's quarantines table as it finds it (ADR-0042): one added by
    another tracker of the database, one lifted, and one it cannot read, which still keeps the
    node out."""
    import json

    from meshnet.tracker.quarantine import Quarantine
    from meshnet.tracker.service import TrackerService, TrackerSettings
    from meshnet.tracker.store import SqliteStore

    svc = TrackerService(TrackerSettings(models=("tiny-llama",)), store=SqliteStore())
    svc.nodes["n1"] = NodeRecord("n1", "http://n1.test:8000", "w", 2 * 1024**3, 1024, "cpu", [], 1.0, "tiny-llama",
                                 2, True)
    record = Quarantine("n1", "entry", "tiny-llama", 2, 3, ("h2", "h3"), {"n1|h2": 0.9}, 0.05, since=10.0)
    svc.dirty = False
    assert svc.apply_quarantines({"n1": json.dumps(record.to_json())}) is True
    assert svc.quarantined == {"n1": record} and svc.nodes["n1"].quarantine == record and svc.dirty
    assert svc.apply_quarantines({"n1": json.dumps(record.to_json())}) is False
    assert svc.apply_quarantines({}) is True and svc.nodes["n1"].quarantine is None
    assert svc.apply_quarantines({"n1": "{not json"}) is True
    assert svc.nodes["n1"].quarantine.reported_by == "unknown (unreadable record)"
