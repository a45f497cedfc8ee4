"""Nodes view (2): one table row per node, keyed by node id, plus a detail pane.

The table is updated by diff (rows added, removed, and only changed cells rewritten), so
the cursor and scroll position survive every refresh. Columns: endpoint, device, memory
budget gauge (weights held / budget), shard slots used/total, ranges with tier,
capability status and age, tokens/s sparkline, requests per minute, last heartbeat.
The highlighted row is the target of the operator actions.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Label, Sparkline, Static

from tui.format import NO_VALUE, format_age, format_bytes, format_bytes_short, format_rate, spark
from tui.state import ConsoleState, NodeHistory, capability_summary, memory_used_bytes, node_ranges, node_rpm
from tui.screens.base import ViewScreen
from tui.widgets.gauge import Gauge, gauge_text
from tui.widgets.palette import Palette

#: (key, label); the ranges column comes last as the only one of unbounded width
COLUMNS = (("node", "node"), ("endpoint", "endpoint"), ("device", "device"), ("memory", "memory"),
           ("slots", "slots"), ("capability", "capability"), ("tps", "tokens/s"), ("rpm", "rpm"),
           ("heartbeat", "last hb"), ("ranges", "layers (tier)"))
CAPABILITY_STYLE = {"ok": "ok", "failed": "bad", "stale": "warn", "none": "muted", "draining": "warn",
                    "quarantined": "bad"}


def capability_text(node: dict, now: float, palette: Palette) -> Text:
    status, age = capability_summary(node, now)
    mark = {"ok": "✓", "failed": "✕", "stale": "⚠", "none": "·", "draining": "⏸", "quarantined": "⛔"}[status]
    text = Text()
    text.append(f"{mark} {status}", style=getattr(palette, CAPABILITY_STYLE[status]))
    if age is not None:
        text.append(f" {format_age(age)}", style=palette.muted)
    return text


def ranges_text(node: dict, palette: Palette, show_model: bool = True) -> Text:
    """``tiny-llama 0-1 pinned, …`` (the model name is left out when the tracker knows one model)."""
    text = Text()
    for i, (model, start, end, tier, admitted) in enumerate(node_ranges(node)):
        if i:
            text.append(", ")
        text.append(f"{model} {start}-{end}" if show_model else f"{start}-{end}",
                    style=None if admitted else palette.muted)
        text.append(f" {tier}", style=palette.muted)
    return text if node_ranges(node) else Text("none", style=palette.muted)


def node_cells(node: dict, history: NodeHistory | None, now: float, palette: Palette,
               show_model: bool = True) -> dict[str, object]:
    """The table cells of one node, by column key."""
    endpoint = node.get("endpoint", "").removeprefix("http://").removeprefix("https://")
    budget = int(node.get("memory_budget_bytes") or 0)
    used = memory_used_bytes(node)
    slots_used, slots_total = int(node.get("slots_used") or 0), int(node.get("slots_total") or 0)
    tps = list(history.tokens_per_s) if history else []
    rpm = node_rpm(node, history)
    tps_text = Text()
    tps_text.append(spark(tps, 6), style=palette.accent)
    tps_text.append(f" {format_rate(tps[-1]) if tps else NO_VALUE}")
    cells = {
        "node": Text(node["node_id"], style="bold"),
        "endpoint": Text(endpoint),
        "device": Text(str(node.get("device") or NO_VALUE)),
        "memory": gauge_text(used, budget, 5, palette, f"{format_bytes_short(used)}/{format_bytes_short(budget)}"),
        "slots": gauge_text(slots_used, slots_total, min(slots_total, 4) or 1, palette, f"{slots_used}/{slots_total}"),
        "capability": capability_text(node, now, palette),
        "tps": tps_text,
        "rpm": Text(format_rate(rpm, 0 if rpm is not None and rpm >= 100 else 1)),
        "heartbeat": Text(format_age(node.get("last_heartbeat_age_s"))),
        "ranges": ranges_text(node, palette, show_model),
    }
    return {key: cells[key] for key, _label in COLUMNS}


def detail_text(node: dict, now: float, palette: Palette, num_layers: dict[str, int] | None = None) -> Text:
    """The detail pane's text: identity, per-shard capability, placement reason, stats."""
    text = Text()
    text.append(node["node_id"], style="bold")
    text.append(f"  {node.get('endpoint', '')}  {node.get('device', '')}  {node.get('quantization', '')}",
                style=palette.muted)
    if node.get("draining"):
        text.append("  draining", style=f"bold {palette.warn}")
    if not node.get("accepts_placement", True):
        text.append("  no placement", style=palette.warn)
    if not node.get("reachable", True):
        text.append(f"\nunreachable: {node.get('reach_error', '')}", style=f"bold {palette.bad}")
    quarantine = node.get("quarantine")
    if quarantine:
        text.append(f"\nquarantined: outvoted over {quarantine['model']} {quarantine['shard_start']}-"
                    f"{quarantine['shard_end']} by {', '.join(quarantine['witnesses'])} (reported by "
                    f"{quarantine['reported_by']}; distances {quarantine['distances']}, tolerance "
                    f"{quarantine['tolerance']}); `meshnet reinstate` lifts it", style=f"bold {palette.bad}")
    for shard in node.get("shards", []):
        cap = shard.get("capability") or {}
        ok = cap.get("passed") and not cap.get("stale") and shard.get("admitted")
        text.append(f"\n{'✓' if ok else '✕'} ", style=palette.ok if ok else palette.bad)
        text.append(f"{shard['model']} {shard['shard_start']}-{shard['shard_end']} {shard.get('tier', '')}"
                    f"{' entry' if shard.get('entry') else ''}  {format_bytes(shard.get('weight_bytes'))}")
        age = f", {format_age(now - cap['timestamp'])} ago" if cap.get("timestamp") else ""
        state = "stale" if cap.get("stale") else "passed" if cap.get("passed") else \
            "no report" if cap.get("passed") is None else "failed"
        text.append(f"  {state}{age}: {cap.get('reason') or ''}", style=palette.muted)
        verification = shard.get("verification") or {}
        if verification.get("state") in ("pending", "rejected"):  # admission by evidence (ADR-0042)
            text.append(f"; {verification['state']}: {verification.get('reason', '')}",
                        style=palette.bad if verification["state"] == "rejected" else palette.muted)
    max_layers = node.get("max_assignable_layers") or {}
    if max_layers:
        fits = []
        for model, n in max_layers.items():
            total = (num_layers or {}).get(model)
            fits.append(f"{model} all {total}" if total and n >= total else f"{model} {n}")
        text.append("\nmemory fits layers of: " + ", ".join(fits), style=palette.muted)
    if node.get("reason"):
        text.append(f"\nplacement: {node['reason']}", style=palette.muted)
    stats = node.get("stats") or {}
    if stats:
        keys = ("sessions", "requests_running", "requests_total", "tokens_processed",
                "decode_latency_s")
        text.append("\n" + "  ".join(f"{k} {stats[k]}" for k in keys if k in stats), style=palette.muted)
    return text


class NodesScreen(ViewScreen):
    """The node table and the selected node's detail pane."""

    MODE = "nodes"
    DEFAULT_CSS = """
    NodesScreen #nodes-table { height: 1fr; }
    NodesScreen #detail { height: auto; max-height: 14; border-top: hkey $panel-lighten-1; padding: 0 1; }
    NodesScreen #detail-gauges { height: 2; }
    NodesScreen #detail-gauges Vertical { width: 1fr; height: 2; }
    NodesScreen #tps-title { color: $text-muted; width: 12; }
    NodesScreen #tps-spark { width: 1fr; max-width: 60; height: 1; }
    NodesScreen #tps-row { height: 1; }
    """

    def __init__(self) -> None:
        super().__init__()
        self._cells: dict[str, dict[str, object]] = {}

    def compose_body(self) -> ComposeResult:
        with Vertical(classes="view-body"):
            table = DataTable(id="nodes-table", cursor_type="row", zebra_stripes=True)
            for key, label in COLUMNS:
                table.add_column(label, key=key)
            yield table
            with Vertical(id="detail"):
                yield Static("no node selected", id="detail-text")
                with Horizontal(id="detail-gauges"):
                    yield Gauge("memory", id="memory-gauge")
                    yield Gauge("slots", id="slots-gauge")
                with Horizontal(id="tps-row"):
                    yield Label("tokens/s", id="tps-title")
                    yield Sparkline([], id="tps-spark")

    def render_state(self, state: ConsoleState) -> None:
        table = self.query_one("#nodes-table", DataTable)
        now, palette = self.app.now(), self.palette
        wanted = {n["node_id"]: n for n in state.nodes
                  if self.matches(n["node_id"], n.get("endpoint"), n.get("device"),
                                  *(f"{m} {a}-{b} {t}" for m, a, b, t, _ in node_ranges(n)))}
        for key in [k.value for k in table.rows if k.value not in wanted]:
            table.remove_row(key)
            self._cells.pop(key, None)
        added = False
        for node_id, node in wanted.items():
            cells = node_cells(node, state.histories.get(node_id), now, palette, len(state.models()) > 1)
            old = self._cells.get(node_id)
            if old is None:
                table.add_row(*cells.values(), key=node_id)
                added = True
            else:
                for col, value in cells.items():
                    if old.get(col) != value:
                        table.update_cell(node_id, col, value, update_width=True)
            self._cells[node_id] = cells
        if added:
            self._sort_keep_cursor(table)
        self._show_detail(state)

    def _sort_keep_cursor(self, table: DataTable) -> None:
        selected = self.app.selected_node_id
        table.sort("node", key=lambda cell: cell.plain if isinstance(cell, Text) else str(cell))
        if selected in self._cells:
            table.move_cursor(row=table.get_row_index(selected))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key is not None and event.row_key.value is not None:
            self.app.selected_node_id = event.row_key.value
            self._show_detail(self.app.state)

    def _show_detail(self, state: ConsoleState) -> None:
        node = state.node(self.app.target_node_id())
        text = self.query_one("#detail-text", Static)
        if node is None:
            text.update("no node selected" if state.nodes else "no node registered with the tracker")
            return
        now, palette = self.app.now(), self.palette
        text.update(detail_text(node, now, palette, {m: state.num_layers(m) or 0 for m in state.models()}))
        budget = int(node.get("memory_budget_bytes") or 0)
        used = memory_used_bytes(node)
        self.query_one("#memory-gauge", Gauge).set_value(used, budget,
                                                         f"{format_bytes(used)} of {format_bytes(budget)} budget")
        s_used, s_total = int(node.get("slots_used") or 0), int(node.get("slots_total") or 0)
        self.query_one("#slots-gauge", Gauge).set_value(s_used, s_total, f"{s_used}/{s_total} shard slots")
        history = state.histories.get(node["node_id"])
        self.query_one("#tps-spark", Sparkline).data = list(history.tokens_per_s) if history else []

    def focus_body(self) -> None:
        self.query_one("#nodes-table", DataTable).focus()
