"""The operator console: ``meshnet tui``.

:class:`MeshnetConsole` connects to a tracker as a client (``meshnet.client.TrackerClient``)
and shows five views, one Textual *mode* each, switched with the number keys:
coverage (1), nodes (2), directives (3), demand (4), traffic (5). One polling worker fetches the
tracker's JSON views (the traffic view's ``/v1/traffic`` only while that view is shown: the
tracker asks every node for it, ADR-0046); polls never overlap (a single exclusive worker loops), the period
is ``interval_s`` and backs off exponentially (cap 30 s) while the tracker is unreachable.
Data from a failed poll is kept but dimmed; a toast appears only when the connection
state changes. Operator actions live in :mod:`tui.actions`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingsMap
from textual.screen import ModalScreen, Screen
from textual.signal import Signal

from meshnet.client import TrackerClient
from meshnet.errors import MeshnetError
from tui.actions import MUTATING_ACTIONS, OperatorActions
from tui.screens.coverage import CoverageScreen
from tui.screens.demand import DemandScreen
from tui.screens.directives import DirectivesScreen
from tui.screens.help import HelpScreen
from tui.screens.nodes import NodesScreen
from tui.screens.traffic import SPARK_BUCKETS as TRAFFIC_BUCKETS, TrafficScreen
from tui.state import ConsoleState, Snapshot
from tui.widgets.topbar import VIEWS

log = logging.getLogger(__name__)

VIEW_KEYS = Binding.Group("Views", compact=True)
ACTION_KEYS = Binding.Group("Act", compact=True)

#: mutating bindings, registered only without ``--readonly`` (ids make them remappable by keymap)
ACTION_BINDINGS = (
    Binding("P", "pin", "Pin", id="pin", group=ACTION_KEYS),
    Binding("D", "doctor", "Doctor", id="doctor", group=ACTION_KEYS),
    Binding("R", "reload", "Reload", id="reload", group=ACTION_KEYS),
    Binding("X", "drain", "Drain", id="drain", group=ACTION_KEYS),
)


class MeshnetConsole(OperatorActions, App[None]):
    """Textual app of the operator console.

    Args:
        url: tracker base URL.
        token: operator bearer token for the mutating calls.
        readonly: hide every mutating action (no bindings, no palette entries).
        interval_s: polling period while connected.
        theme: Textual theme name (unknown names fall back to ``textual-dark``).
        client: a ready :class:`TrackerClient` (tests inject one over ``httpx.ASGITransport``);
            by default one is built from ``url`` and ``token``. The console closes it on exit.
        clock: wall-clock seconds for ages (report timestamps, directive times, last ok);
            tests inject a fixed one.
    """

    TITLE = "meshnet console"
    MODES = {"coverage": CoverageScreen, "nodes": NodesScreen, "directives": DirectivesScreen,
             "demand": DemandScreen, "traffic": TrafficScreen}
    DEFAULT_MODE = "coverage"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
        Binding("r", "refresh", "Refresh", id="refresh"),
        *(Binding(key, f"view('{mode}')", title, id=f"view-{mode}", group=VIEW_KEYS) for mode, key, title in VIEWS),
    ]

    def __init__(self, url: str = "http://127.0.0.1:8700", token: str | None = None, readonly: bool = False,
                 interval_s: float = 2.0, theme: str = "textual-dark", *, client: TrackerClient | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.url = url.rstrip("/")
        self.readonly = readonly
        self.interval_s = interval_s
        self.client = client or TrackerClient(self.url, token=token, timeout_s=max(5.0, interval_s * 2))
        self.clock = clock
        self.state = ConsoleState()
        self.state.connection.base_interval_s = interval_s
        self.state_signal: Signal[ConsoleState] = Signal(self, "state")
        self.selected_node_id: str | None = None
        self._wake = asyncio.Event()
        self._polled = asyncio.Event()
        self._polling = False
        self._theme_fallback = theme not in self.available_themes
        self.theme = "textual-dark" if self._theme_fallback else theme
        if not readonly:
            # App.bind() cannot give bindings ids; merging a map keeps them remappable.
            self._bindings = BindingsMap.merge([self._bindings, BindingsMap(ACTION_BINDINGS)])

    # ---- lifecycle --------------------------------------------------------------------

    def on_mount(self) -> None:
        if self._theme_fallback:
            self.notify("unknown theme; using textual-dark", severity="warning")
        self._poll_loop()

    async def on_unmount(self) -> None:
        await self.client.aclose()

    def now(self) -> float:
        return self.clock()

    # ---- polling ----------------------------------------------------------------------

    @work(exclusive=True, group="poll", exit_on_error=False)
    async def _poll_loop(self) -> None:
        """The one polling worker: poll, then sleep the (backed-off) interval or until woken."""
        while True:
            self._wake.clear()
            self._polling = True
            try:
                await self._poll_once()
            finally:
                self._polling = False
                done, self._polled = self._polled, asyncio.Event()
                done.set()
            try:
                # not wait_for: on Python 3.11 it can swallow a cancel
                async with asyncio.timeout(self.state.connection.next_interval_s):
                    await self._wake.wait()
            except asyncio.TimeoutError:
                pass

    async def _poll_once(self) -> None:
        c = self.client
        calls = [c.nodes(), c.coverage(), c.directives(), c.demand()]
        if self.current_mode == "traffic":
            calls.append(c.traffic(buckets=TRAFFIC_BUCKETS))
        results = await asyncio.gather(*calls, return_exceptions=True)
        if len(results) > 4:
            self._fold_traffic(results.pop())
        error = next((r for r in results if isinstance(r, BaseException)), None)
        now = self.now()
        if error is not None:
            if isinstance(error, MeshnetError):
                message = error.message
            else:  # a malformed answer: keep running, say what happened
                log.exception("poll failed", exc_info=error)
                message = f"unexpected answer from {self.url}: {type(error).__name__}: {error}"
            if self.state.record_failure(message, now):
                self.notify(f"{message}\nretrying with back-off", title="Tracker unreachable", severity="error")
        else:
            nodes, coverage, directives, demand = results
            snapshot = Snapshot(tuple(nodes), tuple(coverage.get("models", [])), tuple(directives),
                                tuple(demand.get("demand", [])), now)
            if self.state.apply(snapshot, now):
                self.notify(f"connected to {self.url} again", title="Tracker reachable")
        self.state_signal.publish(self.state)

    def _fold_traffic(self, result: dict | BaseException) -> None:
        """A traffic answer into the state (a failure is the view's note, not the connection's);
        a toast for each failover that is new since the last answer."""
        if isinstance(result, BaseException):
            message = result.message if isinstance(result, MeshnetError) else f"{type(result).__name__}: {result}"
            self.state.record_traffic_failure(message)
            return
        for event in self.state.apply_traffic(result)[:3]:
            self.notify(f"session {event['session_id'][:8]}: {event['failed_node']} (layers "
                        f"{event['start_layer']}-{event['end_layer']}) → {', '.join(event['replacement'])}",
                        title="Failover", severity="warning")

    async def wait_polled(self, count: int = 1) -> None:
        """Wait until at least ``count`` polls have finished (tests, and after actions).

        Raises:
            RuntimeError: the console stopped (or its poller died) before that.
        """
        while self.state.polls < count:
            if not self.is_running or not any(w.group == "poll" and not w.is_finished for w in self.workers):
                raise RuntimeError("the console stopped polling")
            try:
                async with asyncio.timeout(1.0):  # not wait_for: it can swallow a cancel on 3.11
                    await self._polled.wait()
            except asyncio.TimeoutError:
                pass

    async def refresh_now(self) -> None:
        """Poll now and wait for a poll that started after this call."""
        target = self.state.polls + (2 if self._polling else 1)
        self._wake.set()
        await self.wait_polled(target)

    def wake(self) -> None:
        self._wake.set()

    # ---- actions and bindings ---------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in MUTATING_ACTIONS and self.readonly:
            return False
        if action in MUTATING_ACTIONS | {"view", "help"} and isinstance(self.screen, ModalScreen):
            return False
        return True

    def action_view(self, mode: str) -> None:
        self.switch_mode(mode)
        if mode == "traffic":
            self.wake()  # its data is fetched only while it is shown

    def action_help(self) -> None:
        self.push_screen(HelpScreen(readonly=self.readonly))

    def action_refresh(self) -> None:
        self.wake()

    def target_node_id(self) -> str | None:
        """The node actions apply to: the one selected in the nodes view, else the first."""
        ids = [n["node_id"] for n in self.state.nodes]
        if self.selected_node_id in ids:
            return self.selected_node_id
        return ids[0] if ids else None

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for mode, key, title in VIEWS:
            yield SystemCommand(f"View: {title}", f"Switch to the {title.lower()} view ({key})",
                                lambda mode=mode: self.action_view(mode))
        yield SystemCommand("Refresh", "Poll the tracker now (r)", self.action_refresh)
        if not self.readonly:
            yield from self.operator_commands()
