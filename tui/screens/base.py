"""Base of the four views: top bar, optional filter line, the view's body, footer.

Every view subscribes to the app's ``state_signal`` and re-renders from
:class:`tui.state.ConsoleState` after each poll (and when it is shown again). While the
tracker is unreachable the body is dimmed (class ``-stale``) and the badge turns red.
``/`` opens the filter line; ``esc`` clears and closes it.
"""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Input

from tui.state import ConsoleState
from tui.widgets.palette import Palette
from tui.widgets.topbar import TopBar


class ViewScreen(Screen):
    """Subclasses set ``MODE`` and implement :meth:`compose_body` and :meth:`render_state`."""

    MODE: ClassVar[str] = ""
    DEFAULT_CSS = """
    ViewScreen #filter { dock: top; display: none; border: none; height: 1; padding: 0 1; }
    ViewScreen.-filtering #filter { display: block; }
    ViewScreen .view-body { height: 1fr; }
    ViewScreen.-stale .view-body { opacity: 50%; }
    ViewScreen .empty { color: $text-muted; padding: 1 2; }
    """
    BINDINGS = [
        Binding("slash", "filter", "Filter", key_display="/", id="filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False, id="clear-filter"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.filter_text = ""

    def compose(self) -> ComposeResult:
        yield TopBar(self.app.url, self.MODE, readonly=self.app.readonly)
        yield Input(placeholder="filter: type to narrow the view, esc clears", id="filter", disabled=True)
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        raise NotImplementedError

    def render_state(self, state: ConsoleState) -> None:
        raise NotImplementedError

    # ---- updates ----------------------------------------------------------------------

    def on_mount(self) -> None:
        self.app.state_signal.subscribe(self, self.show_state)
        self.set_interval(1.0, self._tick_badge)
        self.show_state(self.app.state)
        self.focus_body()

    def on_screen_resume(self) -> None:
        self.show_state(self.app.state)

    def show_state(self, state: ConsoleState) -> None:
        self._tick_badge()
        self.set_class(state.connection.stale, "-stale")
        self.render_state(state)

    def _tick_badge(self) -> None:
        conn = self.app.state.connection
        self.query_one(TopBar).set_badge(conn.badge(self.app.now()), conn.connected)

    @property
    def palette(self) -> Palette:
        return Palette.of(self.app)

    def matches(self, *fields: object) -> bool:
        """Whether a row with these fields passes the filter (case-insensitive substring)."""
        if not self.filter_text:
            return True
        return any(self.filter_text in str(f).lower() for f in fields if f is not None)

    # ---- filter -----------------------------------------------------------------------

    def action_filter(self) -> None:
        self.add_class("-filtering")
        box = self.query_one("#filter", Input)
        box.disabled = False
        box.focus()

    def action_clear_filter(self) -> None:
        if not self.has_class("-filtering"):
            return
        box = self.query_one("#filter", Input)
        box.value = ""
        self._close_filter()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self.filter_text = event.value.strip().lower()
            self.render_state(self.app.state)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            if not event.value.strip():
                self._close_filter()
            else:
                self.focus_body()

    def _close_filter(self) -> None:
        self.remove_class("-filtering")
        self.query_one("#filter", Input).disabled = True
        self.focus_body()

    def focus_body(self) -> None:
        """Give focus to the view's main widget (subclasses name it)."""
