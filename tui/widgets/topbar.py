"""Top bar: app name, tracker URL, the view tabs and the connection badge.

The badge reads ``● connected`` (success colour), ``✕ unreachable, last ok 12 s ago``
(error colour) or ``… connecting``; a ``readonly`` tag shows when actions are disabled.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label

#: (mode, key, title) of the views, in key order
VIEWS = (("coverage", "1", "Coverage"), ("nodes", "2", "Nodes"), ("directives", "3", "Directives"),
         ("demand", "4", "Demand"), ("traffic", "5", "Traffic"))


class TopBar(Horizontal):
    """One line at the top of every view."""

    DEFAULT_CSS = """
    TopBar { height: 1; dock: top; background: $panel; }
    TopBar Label { padding: 0 1; }
    TopBar #app-name { text-style: bold; color: $accent; }
    TopBar #url { color: $text-muted; }
    TopBar #tabs { width: 1fr; }
    TopBar #readonly { background: $warning-muted; color: $text; display: none; }
    TopBar.-readonly #readonly { display: block; }
    TopBar #badge.-ok { color: $success; text-style: bold; }
    TopBar #badge.-down { color: $text; background: $error; text-style: bold; }
    TopBar #badge.-unknown { color: $text-muted; }
    """

    def __init__(self, url: str, active: str, *, readonly: bool = False) -> None:
        super().__init__()
        self.url = url
        self.active = active
        self.set_class(readonly, "-readonly")

    def compose(self) -> ComposeResult:
        yield Label("meshnet", id="app-name")
        yield Label(self.url, id="url", markup=False)
        yield Label(self._tabs(), id="tabs")
        yield Label("readonly", id="readonly")
        yield Label("… connecting", id="badge", classes="-unknown", markup=False)

    def _tabs(self) -> str:
        parts = []
        for mode, key, title in VIEWS:
            parts.append(f"[reverse] {key} {title} [/]" if mode == self.active else f" {key} {title} ")
        return "".join(parts)

    def set_badge(self, text: str, connected: bool | None) -> None:
        badge = self.query_one("#badge", Label)
        badge.update(text)
        badge.set_class(connected is True, "-ok")
        badge.set_class(connected is False, "-down")
        badge.set_class(connected is None, "-unknown")
