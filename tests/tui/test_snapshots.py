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
from conftest import SIZE, TRACKER_URL, FakeClock, LazyTrackerTransport, SwitchableTransport, node_payload, \
    heartbeat_payload, \
    shard, tracker_app

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


def seeded_console(**kw) -> tuple[MeshnetConsole, LazyTrackerTransport, FakeClock]:
    transport = LazyTrackerTransport(tracker_app())
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
