"""Doctor report modal: what ``POST /v1/operator/doctor`` returned for one node.

One block per shard report: passed or failed with the reason, measured tokens/s, recipe,
hardware and how old the report is.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from tui.format import format_age, format_bytes
from tui.widgets.palette import Palette


def _hardware(hw: dict) -> str:
    if not hw:
        return ""
    parts = [str(hw.get("device") or "")]
    if hw.get("cpu_count"):
        parts.append(f"{hw['cpu_count']} CPUs")
    if hw.get("ram_bytes"):
        parts.append(f"{format_bytes(hw['ram_bytes'])} RAM")
    if hw.get("vram_bytes"):
        parts.append(f"{format_bytes(hw['vram_bytes'])} VRAM")
    return ", ".join(p for p in parts if p)


def report_text(report: dict, now: float, palette: Palette) -> Text:
    """One report as a few lines of Rich text."""
    passed = bool(report.get("passed"))
    text = Text()
    text.append("✓ passed " if passed else "✕ failed ", style=f"bold {palette.ok if passed else palette.bad}")
    text.append(f"{report.get('model', '?')} layers {report.get('shard_start', '?')}-{report.get('shard_end', '?')}",
                style="bold")
    text.append(f"\n  {report.get('reason') or 'no reason given'}")
    recipe = report.get("recipe") or {}
    details = [f"{float(report.get('tokens_per_s') or 0.0):.1f} tokens/s"]
    if recipe:
        details.append(f"{recipe.get('quantization', '?')} weights, {recipe.get('compute_dtype', '?')} compute")
    if report.get("timestamp"):
        details.append(f"{format_age(now - float(report['timestamp']))} ago")
    text.append("\n  " + " · ".join(details), style=palette.muted)
    hw = _hardware(report.get("hardware") or {})
    if hw:
        text.append(f"\n  {hw}", style=palette.muted)
    return text


class ReportModal(ModalScreen[None]):
    """Shows the doctor reports of one node; ``esc``, ``enter`` or ``q`` closes it."""

    DEFAULT_CSS = """
    ReportModal { align: center middle; }
    ReportModal #dialog {
        width: 90; height: auto; max-height: 80%; padding: 1 2;
        border: thick $primary; background: $surface;
    }
    ReportModal #title { text-style: bold; margin-bottom: 1; }
    ReportModal #reports { height: auto; max-height: 20; }
    ReportModal .report { margin-bottom: 1; }
    ReportModal #close { margin-top: 1; }
    """
    BINDINGS = [Binding("escape,enter,q", "close", "Close", id="report-close")]

    def __init__(self, node_id: str, reports: list[dict], *, now: float) -> None:
        super().__init__()
        self.node_id = node_id
        self.reports = reports
        self.now = now

    def compose(self) -> ComposeResult:
        passed = sum(1 for r in self.reports if r.get("passed"))
        with Vertical(id="dialog"):
            yield Label(f"Doctor on {self.node_id}: {passed}/{len(self.reports)} shard(s) passed", id="title",
                        markup=False)
            with VerticalScroll(id="reports"):
                if not self.reports:
                    yield Static("the node holds no shard: nothing to check")
                for report in self.reports:
                    yield Static(report_text(report, self.now, Palette.of(self.app)), classes="report")
            yield Button("Close", id="close", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
