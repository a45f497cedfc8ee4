"""Demand view (4): queued demand per model, next to whether the model is routable.

Demand is chat requests for a model that could not be served (not routable), counted in
requests per minute over the tracker's demand window; it drives managed placement.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from tui.format import format_ranges, gap_ranges, layer_counts
from tui.state import ConsoleState
from tui.screens.base import ViewScreen

COLUMNS = (("model", "model"), ("demand", "demand (req/min)"), ("routable", "routable"),
           ("covered", "layers covered"), ("gaps", "gaps"), ("holders", "shards"))


class DemandScreen(ViewScreen):
    """A keyed table, one row per model."""

    MODE = "demand"
    DEFAULT_CSS = """
    DemandScreen #demand-table { height: auto; max-height: 1fr; }
    DemandScreen #demand-help { color: $text-muted; padding: 1 1; }
    """

    def __init__(self) -> None:
        super().__init__()
        self._cells: dict[str, dict[str, object]] = {}

    def compose_body(self) -> ComposeResult:
        with Vertical(classes="view-body"):
            table = DataTable(id="demand-table", cursor_type="row", zebra_stripes=True)
            for key, label in COLUMNS:
                table.add_column(label, key=key)
            yield table
            yield Static("Demand counts chat requests for models that are not routable (per minute over the "
                         "tracker's demand window). It drives managed placement: managed nodes move to "
                         "models with demand, under the safety policy (ADR-0005).", id="demand-help")

    def render_state(self, state: ConsoleState) -> None:
        table = self.query_one("#demand-table", DataTable)
        palette = self.palette
        coverage = {c["model"]: c for c in state.coverage}
        rows = {}
        for d in state.demand:
            model = d["model"]
            if not self.matches(model):
                continue
            cov = coverage.get(model, {})
            counts = layer_counts(cov) if cov else []
            gaps = gap_ranges(counts)
            rpm = float(d.get("requests_per_min") or 0.0)
            routable = bool(d.get("routable"))
            rows[model] = {
                "model": Text(model, style="bold"),
                "demand": Text(f"{rpm:.1f}", style=f"bold {palette.warn}" if rpm > 0 else palette.muted),
                "routable": Text("● yes", style=palette.ok) if routable else Text("✕ no", style=palette.bad),
                "covered": Text(f"{cov.get('covered_layers', 0)}/{cov.get('num_layers', 0)}"),
                "gaps": Text(format_ranges(gaps) or "none", style=palette.bad if gaps else palette.muted),
                "holders": Text(str(len(state.holders(model)))),
            }
        for key in [k.value for k in table.rows if k.value not in rows]:
            table.remove_row(key)
            self._cells.pop(key, None)
        for model, cells in rows.items():
            old = self._cells.get(model)
            if old is None:
                table.add_row(*cells.values(), key=model)
            else:
                for col, value in cells.items():
                    if old.get(col) != value:
                        table.update_cell(model, col, value, update_width=True)
            self._cells[model] = cells

    def focus_body(self) -> None:
        self.query_one("#demand-table", DataTable).focus()
