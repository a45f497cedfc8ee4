"""Coverage view (1): per model, a layer bar of node counts, the routable badge, gaps and demand.

Below each bar, the shards that make it up: node, layers, tier, and whether the shard is
admitted (a passed, fresh capability report) — a shard that is loaded but not admitted
does not count toward coverage, which is exactly what an operator needs to see.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Static

from tui.format import format_ranges, gap_ranges, layer_counts
from tui.state import ConsoleState
from tui.screens.base import ViewScreen
from tui.widgets.layer_bar import LayerBar
from tui.widgets.palette import Palette


def header_text(coverage: dict, demand_rpm: float, palette: Palette) -> Text:
    """``tiny-llama  ● routable  4/4 layers  demand 0.0 req/min`` (or the gap, in red)."""
    counts = layer_counts(coverage)
    text = Text()
    text.append(coverage["model"], style="bold")
    text.append("  ")
    if coverage.get("routable"):
        text.append(" ● routable ", style=f"bold {palette.background} on {palette.ok}")
    else:
        text.append(" ✕ not routable ", style=f"bold {palette.foreground} on {palette.bad}")
    text.append(f"  {coverage.get('covered_layers', 0)}/{coverage.get('num_layers', 0)} layers covered")
    gaps = gap_ranges(counts)
    if gaps:
        text.append(f"  gap: layers {format_ranges(gaps)}", style=f"bold {palette.bad}")
    elif coverage.get("num_layers") and not coverage.get("routable"):
        text.append("  no entry node (layer 0 with embeddings)", style=f"bold {palette.warn}")
    if counts:
        text.append(f"  min redundancy {min(counts)}×", style=palette.muted)
    text.append(f"  demand {demand_rpm:.1f} req/min", style=palette.warn if demand_rpm > 0 else palette.muted)
    return text


def holders_text(holders: list[tuple[str, int, int, str, bool]], palette: Palette) -> Text:
    """``node-a 0-1 pinned ✓ · node-b 2-3 bootstrap ✕ not admitted``."""
    if not holders:
        return Text("no node holds a shard of this model", style=palette.muted)
    text = Text()
    for i, (node_id, start, end, tier, admitted) in enumerate(holders):
        if i:
            text.append(" · ", style=palette.muted)
        text.append(node_id, style="bold" if admitted else palette.muted)
        text.append(f" {start}-{end} {tier} ", style=None if admitted else palette.muted)
        text.append("✓" if admitted else "✕ not admitted", style=palette.ok if admitted else palette.bad)
    return text


class ModelCoverage(Vertical):
    """Header, layer bar and holders of one model."""

    DEFAULT_CSS = """
    ModelCoverage { height: auto; padding: 0 1 1 1; border-bottom: hkey $panel-lighten-1; }
    ModelCoverage .model-header { width: 1fr; }
    ModelCoverage LayerBar { margin: 1 0 0 0; }
    ModelCoverage .holders { width: 1fr; color: $text; }
    """

    def __init__(self, coverage: dict, demand_rpm: float, holders: list) -> None:
        super().__init__()
        self.model = coverage["model"]
        self._data = (coverage, demand_rpm, holders)

    def on_mount(self) -> None:
        self._apply()

    def compose(self) -> ComposeResult:
        yield Label(classes="model-header")
        yield LayerBar()
        yield Label(classes="holders")

    def show(self, coverage: dict, demand_rpm: float, holders: list) -> None:
        """Show new data now, or on mount if the children are not composed yet."""
        self._data = (coverage, demand_rpm, holders)
        if self.is_mounted:
            self._apply()

    def _apply(self) -> None:
        coverage, demand_rpm, holders = self._data
        palette = Palette.of(self.app)
        self.query_one(".model-header", Label).update(header_text(coverage, demand_rpm, palette))
        self.query_one(LayerBar).set_counts(layer_counts(coverage))
        self.query_one(".holders", Label).update(holders_text(holders, palette))


class CoverageScreen(ViewScreen):
    """One :class:`ModelCoverage` per tracked model, added and removed as models come and go."""

    MODE = "coverage"
    DEFAULT_CSS = """
    CoverageScreen #models { padding: 1 0 0 0; }
    """

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="models", classes="view-body"):
            yield Static("waiting for the tracker…", id="coverage-empty", classes="empty")

    def render_state(self, state: ConsoleState) -> None:
        body = self.query_one("#models", VerticalScroll)
        wanted = [c for c in state.coverage if self.matches(c["model"])]
        shown = {w.model: w for w in body.query(ModelCoverage)}
        for model, widget in shown.items():
            if model not in {c["model"] for c in wanted}:
                widget.remove()
        empty = self.query_one("#coverage-empty", Static)
        empty.display = not wanted
        if state.snapshot is not None and not wanted:
            empty.update("no model matches the filter" if self.filter_text else "the tracker covers no model yet")
        order = [c["model"] for c in wanted]
        for index, coverage in enumerate(wanted):
            model = coverage["model"]
            widget = shown.get(model)
            if widget is None:  # mount in the tracker's order, before the next model already shown
                after = next((shown[m] for m in order[index + 1:] if m in shown), None)
                new = ModelCoverage(coverage, state.demand_for(model), state.holders(model))
                if after is None:
                    body.mount(new)
                else:
                    body.mount(new, before=after)
            else:
                widget.show(coverage, state.demand_for(model), state.holders(model))

    def focus_body(self) -> None:
        self.query_one("#models").focus()
