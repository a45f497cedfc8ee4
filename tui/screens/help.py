"""Help screen (``?``): keys, views, and what the colours mean. ``esc``, ``?`` or ``q`` closes it."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

KEYS = (("1 2 3 4 5", "views: coverage, nodes, directives, demand, traffic"), ("r", "refresh now"),
        ("/", "filter the view (esc clears)"), ("ctrl+p", "command palette"), ("?", "this help"), ("q", "quit"))
ACTIONS = (("P", "pin a model (and layer range) to the selected node"),
           ("D", "run doctor on the selected node and show its report"),
           ("R", "reload the selected node (reports stale until the next doctor)"),
           ("X", "drain the selected node (no routes, no new placement)"))
LEGEND = ("Coverage: each cell is a layer and shows how many admitted nodes serve it; red cells are gaps "
          "(the model is not routable until every layer is covered and an entry node exists).\n"
          "A shard counts only when admitted: its capability report passed and is fresh.\n"
          "Actions apply to the row highlighted in the nodes view (2) and always ask to confirm "
          "(y / n / esc).\n"
          "Traffic (5): sessions in flight with their routes, per node the last minutes of time to first "
          "token, time per output token, tokens/s and batch size (10 s buckets), and failovers as they "
          "happen.\n"
          "When the tracker is unreachable the badge turns red, the data is dimmed and the console "
          "retries with back-off (up to 30 s).")


def keys_table(readonly: bool) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for key, what in KEYS:
        table.add_row(key, what)
    if readonly:
        table.add_row("", Text("operator actions are disabled (--readonly)", style="italic"))
    else:
        for key, what in ACTIONS:
            table.add_row(key, what)
    return table


class HelpScreen(ModalScreen[None]):
    """Keys and legend."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen #dialog {
        width: 84; height: auto; max-height: 90%; padding: 1 2;
        border: thick $primary; background: $surface;
    }
    HelpScreen #title { text-style: bold; color: $accent; margin-bottom: 1; }
    HelpScreen #help-body { height: auto; max-height: 28; }
    HelpScreen #legend { color: $text-muted; margin-top: 1; }
    HelpScreen #hint { color: $text-muted; margin-top: 1; text-align: right; width: 1fr; }
    """
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close", id="help-close")]

    def __init__(self, readonly: bool = False) -> None:
        super().__init__()
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("meshnet console — keys", id="title")
            with VerticalScroll(id="help-body"):
                yield Static(keys_table(self.readonly), id="keys")
                yield Static(LEGEND, id="legend", markup=False)
            yield Label("esc / ? / q to close", id="hint")

    def action_close(self) -> None:
        self.dismiss(None)
