"""Pilot tests of the console against a real in-process tracker (issue 6 acceptance).

Nodes are fake registrations (passed capability reports); the doctor test runs a real
node endpoint on a socket, which the tracker calls over the network.
"""

from __future__ import annotations

import time

from conftest import MODEL, SIZE, FakeClock, SwitchableTransport, shard
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Input

from tui.modals.confirm import ConfirmModal
from tui.modals.pin import PinModal
from tui.modals.report import ReportModal
from tui.screens.coverage import ModelCoverage
from tui.widgets.layer_bar import LayerBar
from tui.widgets.topbar import TopBar

ACTION_KEYS = ("P", "D", "R", "X")


def plain(widget) -> str:
    content = widget.content
    return content.plain if hasattr(content, "plain") else str(content)


def row_order(table: DataTable) -> list[str]:
    return [table.coordinate_to_cell_key(Coordinate(i, 0)).row_key.value for i in range(table.row_count)]


def model_widget(app, model: str = MODEL) -> ModelCoverage:
    return next(w for w in app.screen.query(ModelCoverage) if w.model == model)


async def two_nodes(tracker) -> None:
    await tracker.register("node-a", [shard(0, 1, tier="pinned")])
    await tracker.register("node-b", [shard(2, 3)])


async def settle(app, pilot) -> None:
    """Poll now, then let the views process the state signal."""
    await app.refresh_now()
    await pilot.pause()


async def wait_for_screen(pilot, kind, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not isinstance(pilot.app.screen, kind):
        assert time.monotonic() < deadline, f"{kind.__name__} never appeared (screen: {pilot.app.screen})"
        await pilot.pause(0.05)
    return pilot.app.screen


async def wait_for_workers(app, pilot) -> None:
    operators = [w for w in app.workers if w.group == "operator"]
    if operators:  # wait_for_complete([]) would wait for every worker, the poller included
        await app.workers.wait_for_complete(operators)
    await pilot.pause()


async def test_coverage_shows_a_gap_when_a_node_leaves_and_closes_it_when_it_returns(tracker):
    await two_nodes(tracker)
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        widget = model_widget(app)
        assert widget.query_one(LayerBar).counts == [1, 1, 1, 1]
        assert "● routable" in plain(widget.query_one(".model-header"))

        await tracker.register("node-b", [])  # node-b comes back holding nothing: layers 2-3 uncovered
        await settle(app, pilot)
        header = plain(widget.query_one(".model-header"))
        assert widget.query_one(LayerBar).counts == [1, 1, 0, 0]
        assert "✕ not routable" in header and "gap: layers 2-3" in header

        await tracker.register("node-b", [shard(2, 3)])
        await settle(app, pilot)
        assert widget.query_one(LayerBar).counts == [1, 1, 1, 1]
        assert "● routable" in plain(widget.query_one(".model-header"))
        assert "gap" not in plain(widget.query_one(".model-header"))


async def test_coverage_gap_after_heartbeat_dropout(tracker):
    await two_nodes(tracker)
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        dropped = tracker.service.check_dropouts(now=time.monotonic() + 3600)
        assert sorted(dropped) == ["node-a", "node-b"]
        await settle(app, pilot)
        widget = model_widget(app)
        assert widget.query_one(LayerBar).counts == [0, 0, 0, 0]
        assert "gap: layers 0-3" in plain(widget.query_one(".model-header"))
        assert "no node holds a shard" in plain(widget.query_one(".holders"))


async def test_pin_through_the_modal_pins_on_the_tracker(tracker):
    await two_nodes(tracker)
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("2")
        await pilot.pause()
        table = app.screen.query_one("#nodes-table", DataTable)
        await pilot.press("down")  # node-b
        await pilot.pause()
        assert app.target_node_id() == "node-b"
        assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value == "node-b"

        await pilot.press("P")
        modal = await wait_for_screen(pilot, PinModal)
        await pilot.press("9", "-", "9", "enter")  # out of range: the form refuses it
        await pilot.pause()
        assert isinstance(app.screen, PinModal)
        assert "layers 0-3" in plain(modal.query_one("#error"))
        modal.query_one("#shard", Input).value = ""
        await pilot.press("0", "-", "3", "enter")
        await wait_for_screen(pilot, ConfirmModal)
        await pilot.press("y")
        await wait_for_workers(app, pilot)

        loads = [d for d in await tracker.client.directives()
                 if d["type"] == "LOAD_SHARD" and d["node_id"] == "node-b"]
        assert [(d["model"], d["shard_start"], d["shard_end"], d["tier"]) for d in loads] == [(MODEL, 0, 3, "pinned")]
        assert tracker.service.store.pins()[0]["node_id"] == "node-b"

        await settle(app, pilot)
        await pilot.press("3")
        await pilot.pause()
        log = app.screen.query_one("#directives-table", DataTable)
        row = log.get_row(str(loads[0]["id"]))
        assert [c.plain for c in row[1:3]] == ["LOAD_SHARD", "node-b"]


async def test_cancelled_confirmation_changes_nothing(tracker):
    await two_nodes(tracker)
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        for answer in ("n", "escape"):
            await pilot.press("R")
            await wait_for_screen(pilot, ConfirmModal)
            await pilot.press(answer)
            await wait_for_workers(app, pilot)
        assert await tracker.client.directives() == []


async def test_doctor_reaches_the_node_and_shows_its_report(tracker, doctor_node):
    await tracker.register("node-a", [shard(0, 3)], endpoint=doctor_node.url)
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("D")
        await wait_for_screen(pilot, ConfirmModal)
        await pilot.press("y")
        report = await wait_for_screen(pilot, ReportModal)
        assert len(doctor_node.calls) == 1
        assert report.node_id == "node-a"
        assert report.reports[0]["tokens_per_s"] == 123.4
        shown = " ".join(plain(w) for w in report.query(".report"))
        assert "✓ passed" in shown and "123.4 tokens/s" in shown
        assert "1/1 shard(s) passed" in plain(report.query_one("#title"))
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, ReportModal)
        doctor = [d for d in await tracker.client.directives() if d["type"] == "RUN_DOCTOR"]
        assert [(d["node_id"], d["status"]) for d in doctor] == [("node-a", "done")]
        nodes = await tracker.client.nodes()
        assert nodes[0]["shards"][0]["capability"]["tokens_per_s"] == 123.4


async def test_doctor_on_an_unreachable_node_is_a_toast_not_a_crash(tracker):
    await tracker.register("node-a", [shard(0, 3)], endpoint="http://127.0.0.1:9")
    app = tracker.console()
    toasts = record_toasts(app)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("D")
        await wait_for_screen(pilot, ConfirmModal)
        await pilot.press("y")
        await wait_for_workers(app, pilot)
        assert not isinstance(app.screen, ReportModal)
        assert any(t["title"] == "doctor failed" and t["severity"] == "error" for t in toasts)
        assert app.is_running


async def test_reload_queues_a_reload_directive(tracker):
    await two_nodes(tracker)
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("R")
        confirm = await wait_for_screen(pilot, ConfirmModal)
        assert confirm.question == "Reload node-a?"
        await pilot.press("y")
        await wait_for_workers(app, pilot)
        reloads = [d for d in await tracker.client.directives() if d["type"] == "RELOAD"]
        assert [(d["node_id"], d["status"]) for d in reloads] == [("node-a", "queued")]

        # the node picks it up on its next heartbeat: the log shows the transition
        await settle(app, pilot)
        await tracker.heartbeat("node-a", [shard(0, 1, tier="pinned")])
        await settle(app, pilot)
        await pilot.press("3")
        await pilot.pause()
        row = app.screen.query_one("#directives-table", DataTable).get_row(str(reloads[0]["id"]))
        assert row[1].plain == "RELOAD"
        assert row[6].plain == "queued → delivered"


async def test_drain_marks_the_node_draining(tracker):
    await two_nodes(tracker)
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("2", "down", "X")
        await wait_for_screen(pilot, ConfirmModal)
        await pilot.press("y")
        await wait_for_workers(app, pilot)
        nodes = {n["node_id"]: n for n in await tracker.client.nodes()}
        assert nodes["node-b"]["draining"] and not nodes["node-a"]["draining"]


async def test_readonly_offers_no_action(tracker):
    await two_nodes(tracker)
    app = tracker.console(readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        bound = {b.action for bindings in app._bindings.key_to_bindings.values() for b in bindings}
        assert bound.isdisjoint({"pin", "doctor", "reload", "drain"})
        assert not set(ACTION_KEYS) & set(app.active_bindings)
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert not {t for t in titles if t.split()[0] in ("Pin", "Doctor", "Reload", "Drain")}
        assert "View: Nodes" in titles
        assert app.check_action("pin", ()) is False
        screens = len(app.screen_stack)
        for key in ACTION_KEYS:
            await pilot.press(key)
            await pilot.pause()
        assert len(app.screen_stack) == screens
        app.action_reload()  # even a direct call does nothing
        await pilot.pause()
        assert len(app.screen_stack) == screens
        assert app.screen.query_one(TopBar).has_class("-readonly")
    assert await tracker.client.directives() == []


async def test_actions_are_offered_without_readonly(tracker):
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert set(ACTION_KEYS) <= set(app.active_bindings)
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"Pin model to node", "Doctor node", "Reload node", "Drain node"} <= titles
        ids = {b.id for bindings in app._bindings.key_to_bindings.values() for b in bindings}
        assert {"pin", "doctor", "reload", "drain"} <= ids


def record_toasts(app) -> list[dict]:
    """Capture the console's toasts (title, message, severity) as they are raised."""
    toasts: list[dict] = []
    notify = app.notify

    def recording(message, *, title="", severity="information", **kw):
        toasts.append({"message": message, "title": title, "severity": severity})
        return notify(message, title=title, severity=severity, **kw)

    app.notify = recording
    return toasts


async def test_unreachable_tracker_badge_back_off_dimming_and_one_toast_per_change(tracker):
    await two_nodes(tracker)
    clock = FakeClock(1_000_000.0)
    switch = SwitchableTransport(tracker.transport)
    app = tracker.console(transport=switch, clock=clock, interval_s=2.0)
    toasts = record_toasts(app)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        bar = app.screen.query_one(TopBar)
        assert plain(bar.query_one("#badge")) == "● connected"
        assert toasts == []

        switch.down = True
        clock.advance(12)
        await settle(app, pilot)
        await settle(app, pilot)
        assert plain(bar.query_one("#badge")) == "✕ unreachable, last ok 12 s ago"
        assert app.screen.has_class("-stale")
        assert model_widget(app).query_one(LayerBar).counts == [1, 1, 1, 1]  # last data kept, dimmed
        assert [t["title"] for t in toasts] == ["Tracker unreachable"]
        assert app.state.connection.failures == 2
        assert app.state.connection.next_interval_s == 8.0

        switch.down = False
        await settle(app, pilot)
        assert plain(bar.query_one("#badge")) == "● connected"
        assert not app.screen.has_class("-stale")
        assert [t["title"] for t in toasts] == ["Tracker unreachable", "Tracker reachable"]
        assert app.state.connection.next_interval_s == 2.0


async def test_nodes_table_keeps_its_cursor_across_refreshes(tracker):
    await two_nodes(tracker)
    await tracker.register("node-c", [shard(0, 3)])
    app = tracker.console()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("2", "down", "down")
        await pilot.pause()
        table = app.screen.query_one("#nodes-table", DataTable)
        assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value == "node-c"
        await tracker.register("node-0", [shard(0, 3)])  # sorts first: rows shift under the cursor
        await tracker.heartbeat("node-c", [shard(0, 3)], {"tokens_per_s": 99.0})
        await settle(app, pilot)
        assert row_order(table) == ["node-0", "node-a", "node-b", "node-c"]
        assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value == "node-c"
        assert app.target_node_id() == "node-c"
        assert "99.0" in table.get_cell("node-c", "tps").plain

        await pilot.press("slash", "n", "o", "d", "e", "-", "a")
        await pilot.pause()
        assert row_order(table) == ["node-a"]
        await pilot.press("escape")
        await pilot.pause()
        assert table.row_count == 4


async def test_polls_never_overlap(tracker):
    await two_nodes(tracker)
    app = tracker.console(interval_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_polled(1)
        for _ in range(5):
            app.wake()
        await pilot.pause(0.5)
        pollers = [w for w in app.workers if w.group == "poll"]
        assert len(pollers) == 1
        assert app.state.polls >= 2


async def test_unknown_theme_falls_back_with_a_warning(tracker):
    app = tracker.console(theme="no-such-theme")
    toasts = record_toasts(app)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.theme == "textual-dark"
        assert [t["severity"] for t in toasts] == ["warning"]
