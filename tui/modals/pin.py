"""Pin form: which model and which layers (inclusive ``start-end``) to pin to a node.

A blank range lets the tracker choose (it picks a gap that fits the node's memory).
The form validates against the model's layer count before anything is sent; the
confirmation modal comes next, so the form itself never mutates.
"""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_shard(text: str, num_layers: int) -> tuple[str | None, str]:
    """``(shard, error)``: ``shard`` is the canonical ``"a-b"`` (or None for blank), ``error`` empty if valid."""
    if not text.strip():
        return None, ""
    m = RANGE.match(text)
    if not m:
        return None, "layers must look like START-END, e.g. 0-3 (inclusive)"
    start, end = int(m.group(1)), int(m.group(2))
    if end < start:
        return None, "END must be ≥ START"
    if num_layers and end >= num_layers:
        return None, f"this model has layers 0-{num_layers - 1}"
    return f"{start}-{end}", ""


class PinModal(ModalScreen["tuple[str, str | None] | None"]):
    """Dismisses with ``(model, shard or None)``, or None when cancelled."""

    DEFAULT_CSS = """
    PinModal { align: center middle; }
    PinModal #dialog {
        width: 64; height: auto; padding: 1 2;
        border: thick $accent; background: $surface;
    }
    PinModal #title { text-style: bold; margin-bottom: 1; }
    PinModal .field { color: $text-muted; margin-top: 1; }
    PinModal #error { color: $error; height: auto; }
    PinModal #buttons { height: auto; margin-top: 1; align-horizontal: right; }
    PinModal Button { margin-left: 2; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="pin-cancel")]

    def __init__(self, node_id: str, models: list[str], num_layers: dict[str, int],
                 default_model: str | None = None) -> None:
        super().__init__()
        self.node_id = node_id
        self.models = models
        self.num_layers = num_layers
        self.default_model = default_model if default_model in models else models[0]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(f"Pin a model to {self.node_id}", id="title", markup=False)
            yield Label("model", classes="field")
            yield Select([(m, m) for m in self.models], value=self.default_model, allow_blank=False, id="model")
            yield Label("layers (inclusive START-END; blank: the tracker chooses)", id="layers-label",
                        classes="field")
            yield Input(placeholder=self._placeholder(self.default_model), id="shard")
            yield Label("", id="error")
            with Horizontal(id="buttons"):
                yield Button("Pin", id="pin", variant="primary")
                yield Button("Cancel", id="cancel")

    def _placeholder(self, model: str) -> str:
        n = self.num_layers.get(model) or 0
        return f"e.g. 0-{n - 1}" if n else "e.g. 0-3"

    def on_mount(self) -> None:
        self.query_one("#shard", Input).focus()

    def on_select_changed(self, event: Select.Changed) -> None:
        self.query_one("#shard", Input).placeholder = self._placeholder(str(event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "pin":
            self._submit()
        else:
            self.dismiss(None)

    def _submit(self) -> None:
        model = str(self.query_one("#model", Select).value)
        shard, error = parse_shard(self.query_one("#shard", Input).value, self.num_layers.get(model, 0))
        if error:
            self.query_one("#error", Label).update(error)
            return
        self.dismiss((model, shard))

    def action_cancel(self) -> None:
        self.dismiss(None)
