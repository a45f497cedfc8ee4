"""Traffic view (5): the data plane now, from the tracker's ``GET /v1/traffic`` (ADR-0046).

Three keyed tables, each updated by diff so the cursor survives a refresh:

- nodes: sessions it drives as entry / KV-cache sessions it holds (entry or hop), and per 10 s bucket over the last two minutes sparklines of time to
  first token, time per output token, tokens/s through the node's layers and batch size, each
  with the last minute's figure beside it (means weighted by their counts); a node the tracker
  could not read says why;
- sessions in flight: route, tokens (prompt + generated), age, time to first token, failovers;
- failovers, newest first: when, session, entry, failed node and its layers, replacement, reason.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Label, Static

from meshnet.protocol.traffic import recent_summary
from tui.format import NO_VALUE, bucket_series, format_age, format_ms, format_rate, route_text, spark
from tui.screens.base import ViewScreen
from tui.state import ConsoleState, failover_key
from tui.widgets.palette import Palette

#: buckets in a sparkline (two minutes of 10 s buckets) and in the figure beside it (one minute)
SPARK_BUCKETS = 12
SUMMARY_BUCKETS = 6

NODE_COLUMNS = (("node", "node"), ("sessions", "entry/KV"), ("ttft", "TTFT"), ("tpot", "TPOT"),
                ("tps", "tokens/s"), ("batch", "batch mean/max"), ("status", "status"))
SESSION_COLUMNS = (("session", "session"), ("model", "model"), ("entry", "entry"), ("tokens", "tokens"),
                   ("age", "age"), ("ttft", "TTFT"), ("failovers", "failovers"), ("route", "route"))
FAILOVER_COLUMNS = (("when", "when"), ("session", "session"), ("entry", "entry"), ("failed", "failed"),
                    ("layers", "layers"), ("replacement", "replacement"), ("reason", "reason"))


def sparked(buckets: list[dict], key: str, figure: str, palette: Palette) -> Text:
    """A sparkline of ``key`` over the last :data:`SPARK_BUCKETS` buckets, then ``figure``."""
    text = Text()
    text.append(spark(bucket_series(buckets, key, SPARK_BUCKETS), SPARK_BUCKETS), style=palette.accent)
    text.append(f" {figure}")
    return text


def node_cells(node: dict, sessions: int, palette: Palette) -> dict[str, object]:
    """The cells of one node's row, by column key."""
    buckets = node.get("buckets") or []
    r = recent_summary(buckets, SUMMARY_BUCKETS)
    batch = NO_VALUE if r["batch_size"] is None else f"{r['batch_size']:.1f}/{r['batch_size_max']}"
    error = node.get("error")
    return {
        "node": Text(node["node_id"], style="bold"),
        "sessions": Text(f"{sessions}/{node.get('kv_sessions') or 0}" if not error else NO_VALUE,
                         style=None if sessions or node.get("kv_sessions") else palette.muted),
        "ttft": sparked(buckets, "ttft_s", format_ms(r["ttft_s"]), palette),
        "tpot": sparked(buckets, "tpot_s", format_ms(r["tpot_s"]), palette),
        "tps": sparked(buckets, "forward_tokens", format_rate(r["tokens_per_s"]) if buckets else NO_VALUE, palette),
        "batch": sparked(buckets, "batch_size", batch, palette),
        "status": Text(f"✕ {error}", style=palette.bad) if error else Text("● ok", style=palette.ok),
    }


def session_cells(session: dict, palette: Palette) -> dict[str, object]:
    failovers = int(session.get("failovers") or 0)
    return {
        "session": Text(session["session_id"][:8], style="bold"),
        "model": Text(session["model"]),
        "entry": Text(session["entry_node"]),
        "tokens": Text(f"{session['prompt_tokens']}+{session['completion_tokens']}"),
        "age": Text(format_age(session["age_s"])),
        "ttft": Text(format_ms(session.get("ttft_s"))),
        "failovers": Text(str(failovers), style=f"bold {palette.warn}" if failovers else palette.muted),
        "route": Text(route_text(session["route"])),
    }


def failover_cells(event: dict, now: float, palette: Palette) -> dict[str, object]:
    return {
        "when": Text(f"{format_age(now - event['at_s'])} ago"),
        "session": Text(event["session_id"][:8], style="bold"),
        "entry": Text(event["entry_node"]),
        "failed": Text(event["failed_node"], style=palette.bad),
        "layers": Text(f"{event['start_layer']}-{event['end_layer']}"),
        "replacement": Text(", ".join(event["replacement"]) or NO_VALUE, style=palette.ok),
        "reason": Text(event.get("reason") or "", style=palette.muted),
    }


def _key(parts: tuple) -> str:
    return "|".join(str(p) for p in parts)


class TrafficScreen(ViewScreen):
    """Nodes, sessions in flight and failovers, each a keyed table."""

    MODE = "traffic"
    DEFAULT_CSS = """
    TrafficScreen .traffic-title { text-style: bold; color: $accent; padding: 0 1; margin-top: 1; }
    TrafficScreen #traffic-note { color: $text-muted; padding: 0 1; }
    TrafficScreen #traffic-note.-error { color: $error; }
    TrafficScreen DataTable { height: auto; max-height: 12; }
    """

    def __init__(self) -> None:
        super().__init__()
        self._cells: dict[str, dict[str, dict[str, object]]] = {}

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(classes="view-body"):
            yield Static("fetching the mesh's traffic…", id="traffic-note", markup=False)
            for table_id, title, columns in (("traffic-nodes", "nodes (sparklines: 10 s buckets, last 2 min; "
                                                               "figures: last minute)", NODE_COLUMNS),
                                             ("traffic-sessions", "sessions in flight", SESSION_COLUMNS),
                                             ("traffic-failovers", "failovers", FAILOVER_COLUMNS)):
                yield Label(title, classes="traffic-title", markup=False)
                table = DataTable(id=table_id, cursor_type="row", zebra_stripes=True)
                for key, label in columns:
                    table.add_column(label, key=key)
                yield table

    def render_state(self, state: ConsoleState) -> None:
        traffic = state.traffic or {}
        palette, now = self.palette, self.app.now()
        note = self.query_one("#traffic-note", Static)
        note.set_class(state.traffic_error is not None, "-error")
        if state.traffic_error is not None:
            note.update(f"traffic unavailable: {state.traffic_error}" + (" (showing the last answer)"
                                                                          if state.traffic else ""))
        elif state.traffic is None:
            note.update("fetching the mesh's traffic…")
        else:
            sessions, failovers = traffic.get("sessions", []), traffic.get("failovers", [])
            note.update(f"{len(sessions)} session(s) in flight · {len(failovers)} recent failover(s) · "
                        f"{len(traffic.get('nodes', []))} node(s)")
        entries: dict[str, int] = {}
        for s in traffic.get("sessions", []):
            entries[s["entry_node"]] = entries.get(s["entry_node"], 0) + 1
        self._diff("traffic-nodes", {
            n["node_id"]: node_cells(n, entries.get(n["node_id"], 0), palette)
            for n in traffic.get("nodes", []) if self.matches(n["node_id"], n.get("error"))})
        self._diff("traffic-sessions", {
            s["session_id"]: session_cells(s, palette)
            for s in traffic.get("sessions", [])
            if self.matches(s["session_id"], s["model"], s["entry_node"], route_text(s["route"]))})
        self._diff("traffic-failovers", {
            _key(failover_key(e)): failover_cells(e, now, palette)
            for e in traffic.get("failovers", [])
            if self.matches(e["session_id"], e["entry_node"], e["failed_node"], *e["replacement"], e.get("reason"))})

    def _diff(self, table_id: str, rows: dict[str, dict[str, object]]) -> None:
        """Make the table hold ``rows`` (by key, in their order): remove gone rows, rewrite changed
        cells, append new ones; only when a new row belongs before others (a new failover, a node
        sorting in between) is the table rebuilt, with the cursor kept on its row."""
        table = self.query_one(f"#{table_id}", DataTable)
        cells = self._cells.setdefault(table_id, {})
        for key in [k.value for k in table.rows if k.value not in rows]:
            table.remove_row(key)
            cells.pop(key, None)
        kept = [k for k in rows if k in cells]
        if list(rows)[:len(kept)] != kept:  # a new row sorts before kept ones
            selected = None
            if table.row_count:
                selected = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            table.clear()
            cells.clear()
            for key, row in rows.items():
                table.add_row(*row.values(), key=key)
                cells[key] = row
            if selected in rows:
                table.move_cursor(row=table.get_row_index(selected))
            return
        for key, row in rows.items():
            old = cells.get(key)
            if old is None:
                table.add_row(*row.values(), key=key)
            else:
                for col, value in row.items():
                    if old.get(col) != value:
                        table.update_cell(key, col, value, update_width=True)
            cells[key] = row

    def focus_body(self) -> None:
        self.query_one("#traffic-nodes", DataTable).focus()
