"""Snapshot tests (pytest-textual-snapshot) of the views, the help screen and the unreachable state.

``snap_compare`` runs the app in its own event loop, so these tests are synchronous and
the tracker's lifespan starts inside that loop (:class:`LazyTrackerTransport`). The
rendered text holds no clock: the console gets a :class:`FakeClock`, report timestamps
are set relative to it, and directive ages fall in a coarse bucket (minutes). Polls run
only when the test asks (``interval_s=60``), so sparklines see a fixed number of samples.

Update the baselines with ``pytest tests/tui --snapshot-update`` and look at the SVGs.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from conftest import SIZE, TRACKER_URL, FakeClock, FakeTraffic, LazyTrackerTransport, SwitchableTransport, \
    failover, heartbeat_payload, node_payload, node_traffic, session, shard, tracker_app

from meshnet.client import TrackerClient
from tests.payloads import SignAsNodes
from tui.app import MeshnetConsole

#: directives are created at real time; the console's clock runs this far ahead of it, so
#: their age renders as "17 min" for any test that takes under half a minute
CLOCK_AHEAD_S = 1050.0
REPORT_AGE_S = 42.0


class Borrowed(httpx.AsyncBaseTransport):
    """Shares the console's transport without closing it (the console owns it)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        pass


def layout(clock: FakeClock) -> dict[str, list[dict]]:
    ts = clock.now - REPORT_AGE_S
    return {
        "node-a": [shard(0, 1, tier="pinned", timestamp=ts, tokens_per_s=48.0)],
        "node-b": [shard(2, 3, timestamp=ts, tokens_per_s=35.0)],
        "node-c": [shard(0, 3, timestamp=ts, tokens_per_s=21.0),
                   shard(0, 1, model="tiny-gpt2", timestamp=ts, tokens_per_s=30.0, weight_bytes=200_704)],
    }


async def seed(app: MeshnetConsole, transport: httpx.AsyncBaseTransport, clock: FakeClock) -> None:
    """Three nodes (tiny-llama covered, tiny-gpt2 with a gap), a pin, a reload, six polls of stats."""
    await app.wait_polled(1)
    client = TrackerClient(TRACKER_URL, transport=Borrowed(transport), auth=SignAsNodes())  # fake nodes sign
    shards = layout(clock)
    for i, (node_id, held) in enumerate(shards.items()):
        await client.register(node_payload(node_id, f"http://10.0.0.{i + 1}:8701", held,
                                           max_loaded_shards=3 if node_id == "node-c" else 2))
    await client.pin("tiny-llama", "node-a", "2-3")
    await client.reload("node-b")
    await app.refresh_now()
    wobble = (0.0, 6.0, 3.0, 9.0, 4.0, 12.0)
    for step in range(6):
        clock.advance(2.0)
        for i, (node_id, held) in enumerate(shards.items()):
            stats = {"tokens_per_s": shards[node_id][0]["report"]["tokens_per_s"] + wobble[step] * (1 - i / 2),
                     "requests_total": 4 * step * (i + 1), "sessions": i, "requests_running": 0}
            await client.heartbeat(node_id, heartbeat_payload(held, stats))
        await app.refresh_now()


def seeded_console(traffic: FakeTraffic | None = None, **kw) -> tuple[MeshnetConsole, LazyTrackerTransport, FakeClock]:
    transport = LazyTrackerTransport(tracker_app(traffic))
    clock = FakeClock(time.time() + CLOCK_AHEAD_S)
    app = MeshnetConsole(url=TRACKER_URL, client=TrackerClient(TRACKER_URL, transport=transport),
                         interval_s=60.0, clock=clock, **kw)
    return app, transport, clock


def snapshot_of(snap_compare, keys: tuple[str, ...] = (), **kw) -> bool:
    app, transport, clock = seeded_console(**kw)

    async def run_before(pilot) -> None:
        await seed(pilot.app, transport, clock)
        for key in keys:
            await pilot.press(key)
            await pilot.pause()

    return snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_coverage_view(snap_compare):
    assert snapshot_of(snap_compare)


def test_nodes_view(snap_compare):
    assert snapshot_of(snap_compare, ("2",))


def test_directives_view(snap_compare):
    assert snapshot_of(snap_compare, ("3",))


def test_demand_view(snap_compare):
    assert snapshot_of(snap_compare, ("4",))


def traffic_answers(clock: FakeClock) -> dict[str, dict]:
    """node-a drives two sessions (one failed over from node-b to node-c), node-b answers with a
    quiet history, node-c (10.0.0.3) does not answer."""
    rows = [(0.21, 0.048, 120, 1.0), (0.35, 0.052, 480, 2.5), (0.28, 0.05, 260, 1.5), (0.42, 0.061, 720, 4.0),
            (0.3, 0.055, 400, 3.0), (0.25, 0.05, 300, 2.0)]
    return {
        "10.0.0.1": node_traffic("node-a", rows=rows, sessions=[
            session("5f1c9a0e22b4", "node-a", [("node-a", 0, 1), ("node-c", 2, 3)], age_s=48.0, ttft_s=0.31,
                    tokens=(212, 96), failovers=1),
            session("c07d33e1aa90", "node-a", [("node-a", 0, 1), ("node-b", 2, 3)], age_s=4.0, ttft_s=None,
                    tokens=(37, 0))],
            failovers=[failover("5f1c9a0e22b4", "node-a", "node-b", ["node-c"], clock.now - 21.0,
                                reason="hop node-b at http://10.0.0.2:8701 (layers 2-3) missed its 0.50 s "
                                       "deadline on 1 token(s) (frozen)")]),
        "10.0.0.2": node_traffic("node-b", rows=[(None, None, 96, 1.0)] * 6, kv_sessions=1),
    }


def test_traffic_view(snap_compare):
    traffic = FakeTraffic()
    app, transport, clock = seeded_console(traffic)
    traffic.answers = traffic_answers(clock)

    async def run_before(pilot) -> None:
        await seed(pilot.app, transport, clock)
        await pilot.press("5")
        await pilot.app.refresh_now()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare):
    assert snapshot_of(snap_compare, ("question_mark",))


def test_readonly_help_screen(snap_compare):
    assert snapshot_of(snap_compare, ("question_mark",), readonly=True)


def _port_is_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_unreachable_tracker(snap_compare):
    """The console pointed at a closed port: red badge, a toast, no crash."""
    if not _port_is_closed(9):
        pytest.skip("something listens on 127.0.0.1:9")
    app = MeshnetConsole(url="http://127.0.0.1:9", interval_s=2.0, clock=FakeClock(1_000_000.0))

    async def run_before(pilot) -> None:
        await pilot.app.wait_polled(1)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_connection_lost(snap_compare):
    """Connected, then the tracker goes away: the last data stays, dimmed; badge says since when."""
    lazy = LazyTrackerTransport(tracker_app())
    switch = SwitchableTransport(lazy)
    clock = FakeClock(time.time() + CLOCK_AHEAD_S)
    app = MeshnetConsole(url=TRACKER_URL, client=TrackerClient(TRACKER_URL, transport=switch), interval_s=60.0,
                         clock=clock)

    async def run_before(pilot) -> None:
        await seed(pilot.app, lazy, clock)
        switch.down = True
        clock.advance(12.0)
        await pilot.app.refresh_now()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
