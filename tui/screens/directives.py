"""Directives view (3): the live log of LOAD_SHARD / DROP_SHARD / RUN_DOCTOR / RELOAD.

Oldest first, one row per directive keyed by its id. The status column shows every
status the console has seen the directive in (``queued → delivered → done``), so
transitions are visible as they happen. Rows are kept after the tracker's window moves
on (bounded at :data:`MAX_ROWS`); when the cursor sits on the last row, the view follows
new entries.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable

from tui.format import NO_VALUE, format_age
from tui.state import ConsoleState
from tui.screens.base import ViewScreen
from tui.widgets.palette import Palette

MAX_ROWS = 1000
COLUMNS = (("id", "#"), ("type", "type"), ("node", "node"), ("model", "model"), ("range", "layers"),
           ("tier", "tier"), ("status", "status"), ("age", "age"), ("note", "reason / error"))
STATUS_STYLE = {"queued": "muted", "delivered": "accent", "acked": "accent", "done": "ok", "failed": "bad"}


def status_text(trail: list[str], palette: Palette) -> Text:
    text = Text()
    for i, status in enumerate(trail):
        if i:
            text.append(" → ", style=palette.muted)
        last = i == len(trail) - 1
        colour = getattr(palette, STATUS_STYLE.get(status, "muted"))
        text.append(status, style=f"bold {colour}" if last else palette.muted)
    return text


def directive_cells(d: dict, trail: list[str], now: float, palette: Palette) -> dict[str, object]:
    layers = f"{d['shard_start']}-{d['shard_end']}" if d.get("shard_start") is not None else NO_VALUE
    note = Text(d["error"], style=palette.bad) if d.get("error") else Text(d.get("reason") or "", style=palette.muted)
    return {
        "id": Text(str(d["id"]), style=palette.muted),
        "type": Text(d["type"], style="bold"),
        "node": Text(d["node_id"]),
        "model": Text(d.get("model") or NO_VALUE),
        "range": Text(layers),
        "tier": Text(d.get("tier") or NO_VALUE),
        "status": status_text(trail or [d["status"]], palette),
        "age": Text(format_age(now - d["created_at"]) if d.get("created_at") else NO_VALUE),
        "note": note,
    }


class DirectivesScreen(ViewScreen):
    """A keyed, append-only table of directives."""

    MODE = "directives"
    DEFAULT_CSS = """
    DirectivesScreen #directives-table { height: 1fr; }
    """

    def __init__(self) -> None:
        super().__init__()
        self._cells: dict[str, dict[str, object]] = {}
        self._rows: dict[str, dict] = {}

    def compose_body(self) -> ComposeResult:
        with Vertical(classes="view-body"):
            table = DataTable(id="directives-table", cursor_type="row", zebra_stripes=True)
            for key, label in COLUMNS:
                table.add_column(label, key=key)
            yield table

    def render_state(self, state: ConsoleState) -> None:
        table = self.query_one("#directives-table", DataTable)
        for d in state.directives:
            self._rows[str(d["id"])] = d
        for old in sorted(self._rows, key=int)[:-MAX_ROWS]:
            del self._rows[old]
        wanted = {k: d for k, d in sorted(self._rows.items(), key=lambda kv: int(kv[0]))
                  if self.matches(d["type"], d["node_id"], d.get("model"), d["status"], d.get("tier"))}
        following = table.row_count == 0 or table.cursor_row >= table.row_count - 1
        for key in [k.value for k in table.rows if k.value not in wanted]:
            table.remove_row(key)
            self._cells.pop(key, None)
        now, palette = self.app.now(), self.palette
        for key, d in wanted.items():
            cells = directive_cells(d, state.trails.get(d["id"], []), now, palette)
            old = self._cells.get(key)
            if old is None:
                table.add_row(*cells.values(), key=key)
            else:
                for col, value in cells.items():
                    if old.get(col) != value:
                        table.update_cell(key, col, value, update_width=True)
            self._cells[key] = cells
        if following and table.row_count:
            table.move_cursor(row=table.row_count - 1)

    def focus_body(self) -> None:
        self.query_one("#directives-table", DataTable).focus()
