"""Table-driven tests of the console's pure parts: formatting, back-off, state folding, forms."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tui.connection import Connection, backoff_interval_s
from tui.format import bar_cells, format_age, format_bytes, format_bytes_short, gap_ranges, layer_counts, spark
from tui.modals.pin import parse_shard
from tui.state import HISTORY_LEN, ConsoleState, NodeHistory, Snapshot, capability_summary, node_rpm
from tui.widgets.layer_bar import _axis


@pytest.mark.parametrize("seconds, text", [(None, "—"), (-3, "0 s"), (0.4, "0 s"), (12.9, "12 s"), (60, "1 min"),
                                           (1050, "17 min"), (7200, "2 h"), (200_000, "2 d")])
def test_format_age(seconds, text):
    assert format_age(seconds) == text


@pytest.mark.parametrize("n, long, short", [(0, "0 B", "0B"), (1023, "1023 B", "1023B"), (115_200, "112.5 KiB", "112K"),
                                            (int(1.6 * 1024**3), "1.6 GiB", "1.6G"), (None, "—", "—")])
def test_format_bytes(n, long, short):
    assert format_bytes(n) == long
    assert format_bytes_short(n) == short


@pytest.mark.parametrize("values, text", [([], ""), ([5, 5, 5], "▄▄▄"), ([0, 0], "▁▁"), ([0, 7], "▁█"),
                                          (list(range(20)), None)])
def test_spark(values, text):
    out = spark(values, width=12)
    if text is None:
        assert len(out) == 12 and out[0] == "▁" and out[-1] == "█"
    else:
        assert out == text


def test_layer_counts_and_gaps():
    cov = {"num_layers": 6, "segments": [{"start_layer": 0, "end_layer": 1, "node_count": 2},
                                         {"start_layer": 2, "end_layer": 3, "node_count": 0},
                                         {"start_layer": 4, "end_layer": 4, "node_count": 1},
                                         {"start_layer": 5, "end_layer": 5, "node_count": 0}]}
    counts = layer_counts(cov)
    assert counts == [2, 2, 0, 0, 1, 0]
    assert gap_ranges(counts) == [(2, 3), (5, 5)]
    assert gap_ranges([1, 1]) == []


@pytest.mark.parametrize("counts, width, cells", [
    ([1, 2, 3, 4], 10, [(0, 0, 1), (1, 1, 2), (2, 2, 3), (3, 3, 4)]),
    ([1, 0, 3, 4], 2, [(0, 1, 0), (2, 3, 3)]),   # a cell shows the minimum: the gap survives compression
    ([], 10, []),
])
def test_bar_cells(counts, width, cells):
    assert bar_cells(counts, width) == cells


def test_axis_labels_do_not_overlap():
    assert _axis([(0, 0, 1), (1, 1, 1)], 4) == " 0   1  "
    assert _axis(bar_cells([1] * 30, 10), 3) == "0  3  6  9  12 15 18 21 24  29"  # last layer right-aligned
    assert _axis(bar_cells([1] * 30, 30), 1) == "0 2 4 6 8 10 13 16 19 22 25 28"


@pytest.mark.parametrize("failures, interval", [(0, 2.0), (1, 4.0), (2, 8.0), (3, 16.0), (4, 30.0), (50, 30.0)])
def test_backoff(failures, interval):
    assert backoff_interval_s(2.0, failures) == interval


def test_connection_changes_only_on_transitions():
    conn = Connection(base_interval_s=2.0)
    assert conn.badge(0) == "… connecting"
    assert conn.record_ok(100.0) is False  # first contact is not a change worth a toast
    assert conn.badge(101) == "● connected"
    assert conn.record_failure("refused", 105.0) is True
    assert conn.record_failure("refused", 110.0) is False
    assert conn.stale and conn.next_interval_s == 8.0
    assert conn.badge(112.0) == "✕ unreachable, last ok 12 s ago"
    assert conn.record_ok(120.0) is True and conn.next_interval_s == 2.0
    never = Connection()
    never.record_failure("refused", 1.0)
    assert never.badge(50) == "✕ unreachable, never connected"


def _node(node_id: str, tps: float = 0.0, requests: int | None = None, **kw) -> dict:
    stats = {"tokens_per_s": tps}
    if requests is not None:
        stats["requests_total"] = requests
    return {"node_id": node_id, "stats": stats, "shards": kw.get("shards", [])}


def test_state_histories_are_bounded_and_follow_nodes():
    state = ConsoleState()
    for i in range(HISTORY_LEN + 10):
        state.apply(Snapshot(nodes=(_node("a", tps=float(i), requests=i * 10),)), now=float(i))
    assert len(state.histories["a"].tokens_per_s) == HISTORY_LEN
    assert state.histories["a"].tokens_per_s[-1] == HISTORY_LEN + 9
    assert state.histories["a"].rpm() == pytest.approx(600.0)  # 10 requests a second
    state.apply(Snapshot(nodes=()), now=999.0)
    assert state.histories == {}


def test_rpm_needs_a_few_seconds_of_samples():
    history = NodeHistory()
    history.add(_node("a", requests=0), 0.0)
    history.add(_node("a", requests=5), 0.1)
    assert history.rpm() is None
    history.add(_node("a", requests=10), 6.0)
    assert history.rpm() == pytest.approx(100.0)


def test_directive_trails_record_transitions():
    state = ConsoleState()
    for status in ("queued", "queued", "delivered", "done"):
        state.apply(Snapshot(directives=({"id": 7, "status": status},)), now=0.0)
    assert state.trails[7] == ["queued", "delivered", "done"]
    state.apply(Snapshot(directives=()), now=0.0)
    assert state.trails == {}


@pytest.mark.parametrize("caps, draining, status", [
    ([], False, "none"),
    ([{"passed": True, "stale": False, "timestamp": 90}], False, "ok"),
    ([{"passed": True, "stale": True, "timestamp": 90}], False, "stale"),
    ([{"passed": True, "timestamp": 90}, {"passed": False, "timestamp": 80}], False, "failed"),
    ([{"passed": None}], False, "none"),
    ([{"passed": True, "timestamp": 90}], True, "draining"),
    ([{"passed": True, "timestamp": 90}], "quarantined", "quarantined"),  # over draining and ok (ADR-0042)
])
def test_capability_summary(caps, draining, status):
    quarantine = {"witnesses": ["b", "c"]} if draining == "quarantined" else None
    node = {"draining": draining is True, "quarantine": quarantine, "shards": [{"capability": c} for c in caps]}
    got, age = capability_summary(node, now=100.0)
    assert got == status
    stamps = [c["timestamp"] for c in caps if c.get("timestamp")]
    assert age == (100.0 - min(stamps) if stamps else None)


@pytest.mark.parametrize("text, layers, result", [
    ("", 4, (None, "")), ("0-3", 4, ("0-3", "")), (" 1 - 2 ", 4, ("1-2", "")),
    ("3-1", 4, (None, "END must be ≥ START")), ("0-4", 4, (None, "this model has layers 0-3")),
    ("abc", 4, (None, "layers must look like START-END, e.g. 0-3 (inclusive)")),
])
def test_parse_shard(text, layers, result):
    assert parse_shard(text, layers) == result


def test_headless_modules_never_import_textual():
    code = ("import sys, meshnet.client, meshnet.tracker.app, tui.state, tui.connection, tui.format; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'textual']; print(bad); assert not bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_console_talks_to_services_only_through_the_client():
    from pathlib import Path

    import tui

    sources = list(Path(tui.__file__).parent.rglob("*.py"))
    assert sources
    for path in sources:
        for line in path.read_text().splitlines():
            if line.lstrip().startswith(("import meshnet", "from meshnet")):
                module = line.split()[1]
                assert module in ("meshnet.client", "meshnet.errors", "meshnet.layers", "meshnet.protocol.traffic"), \
                    f"{path}: {line}"


def test_node_rpm_prefers_the_nodes_own_figure():
    history = NodeHistory()
    history.add(_node("a", requests=0), 0.0)
    history.add(_node("a", requests=10), 6.0)
    assert node_rpm({"stats": {"requests_per_min": 3.5}}, history) == 3.5
    assert node_rpm({"stats": {}}, history) == pytest.approx(100.0)
    assert node_rpm({"stats": {}}, None) is None


def test_node_detail_names_an_unreachable_endpoint_and_why():
    from tui.screens.nodes import detail_text
    from tui.widgets.palette import Palette

    palette = Palette(ok="green", bad="red", warn="yellow", accent="blue", muted="grey50", foreground="white",
                      background="black")
    node = {"node_id": "n1", "endpoint": "http://10.0.0.9:8701", "shards": [], "reachable": False,
            "reach_error": "GET http://10.0.0.9:8701/v1/health failed: ConnectTimeout"}
    assert "unreachable: GET http://10.0.0.9:8701/v1/health failed: ConnectTimeout" in detail_text(node, 0.0, palette).plain
    assert "unreachable" not in detail_text({**node, "reachable": True}, 0.0, palette).plain


# ---- traffic (ADR-0046) --------------------------------------------------------------------


@pytest.mark.parametrize("seconds, text", [(None, "—"), (0.0004, "0 ms"), (0.25, "250 ms"), (9.9994, "9999 ms"),
                                           (12.34, "12.3 s")])
def test_format_ms(seconds, text):
    from tui.format import format_ms

    assert format_ms(seconds) == text


def test_bucket_series_takes_the_tail_and_draws_empty_buckets_at_zero():
    from tui.format import bucket_series

    rows = [{"ttft_s": 0.1}, {"ttft_s": None}, {"ttft_s": 0.3}, {}]
    assert bucket_series(rows, "ttft_s", 3) == [0.0, 0.3, 0.0]
    assert bucket_series([], "ttft_s", 3) == []


def test_route_text_is_inclusive_like_the_api():
    from tui.format import route_text

    route = [{"node_id": "a", "start_layer": 0, "end_layer": 9}, {"node_id": "b", "start_layer": 10, "end_layer": 29}]
    assert route_text(route) == "a 0-9 → b 10-29"


def _event(session: str, at: float) -> dict:
    return {"session_id": session, "failed_node": "b", "at_s": at}


def test_failovers_are_news_only_after_the_first_traffic_answer():
    state = ConsoleState()
    assert state.apply_traffic({"failovers": [_event("s1", 5.0)]}) == []  # history, not news
    assert state.apply_traffic({"failovers": [_event("s2", 7.0), _event("s3", 6.0), _event("s1", 5.0)]}) == \
        [_event("s2", 7.0), _event("s3", 6.0)]
    assert state.apply_traffic({"failovers": [_event("s2", 7.0)]}) == []
    state.record_traffic_failure("tracker timed out")
    assert (state.traffic_error, state.traffic["failovers"]) == ("tracker timed out", [_event("s2", 7.0)])
    state.apply_traffic({"failovers": []})
    assert state.traffic_error is None
