"""Pilot tests of the traffic view (5) against a real in-process tracker whose fake nodes answer
``GET /v1/traffic`` (ADR-0046)."""

from __future__ import annotations

from conftest import SIZE, FakeClock, failover, node_traffic, session, shard
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Static

NOW = 1_000_000.0


def row_keys(table: DataTable) -> list[str]:
    return [table.coordinate_to_cell_key(Coordinate(i, 0)).row_key.value for i in range(table.row_count)]


def cell(table: DataTable, row: str, column: str) -> str:
    value = table.get_cell(row, column)
    return value.plain if hasattr(value, "plain") else str(value)


async def seed(tracker) -> None:
    await tracker.register("node-a", [shard(0, 1, tier="pinned")])
    await tracker.register("node-b", [shard(2, 3)])
    await tracker.register("node-c", [shard(2, 3)])
    rows = [(0.2, 0.05, 100, 1.0), (0.3, 0.04, 200, 2.0), (0.4, 0.05, 300, 3.0)]
    tracker.traffic.answers = {
        "node-a.test": node_traffic("node-a", rows=rows, sessions=[
            session("aaaa1111", "node-a", [("node-a", 0, 1), ("node-b", 2, 3)], age_s=12.0),
            session("bbbb2222", "node-a", [("node-a", 0, 1), ("node-b", 2, 3)], age_s=2.0, ttft_s=None,
                    tokens=(9, 0))]),
        "node-b.test": node_traffic("node-b", rows=[(None, None, 50, 2.0)] * 3, kv_sessions=2),
    }  # node-c does not answer


async def test_the_traffic_view_shows_nodes_sessions_and_failovers_as_they_happen(tracker):
    await seed(tracker)
    app = tracker.console(clock=FakeClock(NOW))
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_polled(1)
        calls_before = tracker.traffic.calls
        await app.refresh_now()
        assert tracker.traffic.calls == calls_before  # not fetched while another view is shown
        await pilot.press("5")
        await app.refresh_now()
        await pilot.pause()
        assert app.current_mode == "traffic"
        nodes = app.screen.query_one("#traffic-nodes", DataTable)
        assert row_keys(nodes) == ["node-a", "node-b", "node-c"]
        # last minute of node-a: ttft (0.2+0.3+0.4)/3, tpot (0.05+0.04+0.05)/3, 600 tokens / 30 s, batch 2.0
        assert cell(nodes, "node-a", "ttft") == "▁▄█ 300 ms"
        assert cell(nodes, "node-a", "tpot") == "█▁█ 47 ms"
        assert cell(nodes, "node-a", "tps") == "▁▅█ 20.0"
        assert cell(nodes, "node-a", "batch") == "▁▅█ 2.0/3"
        assert [cell(nodes, n, "sessions") for n in ("node-a", "node-b", "node-c")] == ["2/2", "0/2", "—"]
        assert cell(nodes, "node-a", "status") == "● ok"
        assert [cell(nodes, "node-b", c) for c in ("ttft", "tpot", "tps", "batch")] == \
            ["▁▁▁ —", "▁▁▁ —", "▄▄▄ 5.0", "▄▄▄ 2.0/2"]
        assert [cell(nodes, "node-c", c) for c in ("ttft", "tps", "batch")] == [" —", " —", " —"]
        assert cell(nodes, "node-c", "status").startswith("✕ GET http://node-c.test:8701/v1/traffic ConnectError")
        sessions = app.screen.query_one("#traffic-sessions", DataTable)
        assert row_keys(sessions) == ["aaaa1111", "bbbb2222"]
        assert [cell(sessions, "aaaa1111", c) for c in ("entry", "tokens", "age", "ttft", "failovers", "route")] == \
            ["node-a", "40+7", "12 s", "250 ms", "0", "node-a 0-1 → node-b 2-3"]
        assert cell(sessions, "bbbb2222", "ttft") == "—"
        failovers = app.screen.query_one("#traffic-failovers", DataTable)
        assert failovers.row_count == 0
        note = app.screen.query_one("#traffic-note", Static)
        assert str(note.content) == "2 session(s) in flight · 0 recent failover(s) · 3 node(s)"

        # node-b freezes: node-a's session moves to node-c, and the view shows it on the next poll
        sessions.move_cursor(row=1)
        answer = tracker.traffic.answers["node-a.test"]
        answer["sessions"][0] = session("aaaa1111", "node-a", [("node-a", 0, 1), ("node-c", 2, 3)], age_s=13.0,
                                        failovers=1)
        answer["failovers"] = [failover("aaaa1111", "node-a", "node-b", ["node-c"], NOW - 1.0)]
        await app.refresh_now()
        await pilot.pause()
        assert [cell(failovers, row_keys(failovers)[0], c) for c in ("when", "session", "failed", "layers",
                                                                     "replacement", "reason")] == \
            ["1 s ago", "aaaa1111", "node-b", "2-3", "node-c", "missed its deadline (frozen)"]
        assert cell(sessions, "aaaa1111", "route") == "node-a 0-1 → node-c 2-3"
        assert cell(sessions, "aaaa1111", "failovers") == "1"
        assert sessions.cursor_row == 1  # the cursor stays on its row across refreshes
        toasts = [n for n in app._notifications if n.title == "Failover"]
        assert [t.message for t in toasts] == ["session aaaa1111: node-b (layers 2-3) → node-c"]

        # a second failover comes first; the first one does not toast again
        answer["failovers"].insert(0, failover("bbbb2222", "node-a", "node-c", ["node-b"], NOW))
        await app.refresh_now()
        await pilot.pause()
        assert [cell(failovers, k, "session") for k in row_keys(failovers)] == ["bbbb2222", "aaaa1111"]
        assert len([n for n in app._notifications if n.title == "Failover"]) == 2


async def test_the_filter_narrows_every_traffic_table(tracker):
    await seed(tracker)
    tracker.traffic.answers["node-a.test"]["failovers"] = [failover("aaaa1111", "node-a", "node-b", ["node-c"],
                                                                    NOW - 30.0)]
    app = tracker.console(clock=FakeClock(NOW))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("5")
        await app.refresh_now()
        await pilot.pause()
        await pilot.press("slash", *"bbbb")
        await pilot.pause()
        screen = app.screen
        assert screen.query_one("#traffic-nodes", DataTable).row_count == 0
        assert row_keys(screen.query_one("#traffic-sessions", DataTable)) == ["bbbb2222"]
        assert screen.query_one("#traffic-failovers", DataTable).row_count == 0


async def test_a_tracker_without_traffic_leaves_the_other_views_connected(tracker):
    await seed(tracker)
    app = tracker.console(clock=FakeClock(NOW))
    tracker.app.state.traffic.traffic = _broken
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("5")
        await app.refresh_now()
        await pilot.pause()
        assert app.state.connection.connected is True
        note = app.screen.query_one("#traffic-note", Static)
        assert str(note.content).startswith("traffic unavailable: ")
        assert note.has_class("-error")


async def _broken():
    raise RuntimeError("gathering failed")
