"""Confirmation modal for every mutating action: ``y`` confirms, ``n`` or ``esc`` cancels.

Focus starts on "No", so an absent-minded ``enter`` never mutates anything.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConfirmModal(ModalScreen[bool]):
    """Dismisses with True (confirmed) or False."""

    DEFAULT_CSS = """
    ConfirmModal { align: center middle; }
    ConfirmModal #dialog {
        width: 64; height: auto; padding: 1 2;
        border: thick $warning; background: $surface;
    }
    ConfirmModal #question { text-style: bold; width: 1fr; }
    ConfirmModal #detail { color: $text-muted; margin-top: 1; width: 1fr; }
    ConfirmModal #buttons { height: auto; margin-top: 1; align-horizontal: right; }
    ConfirmModal Button { margin-left: 2; }
    """
    BINDINGS = [
        Binding("y", "confirm", "Yes", id="confirm-yes"),
        Binding("n", "cancel", "No", id="confirm-no"),
        Binding("escape", "cancel", "Cancel", id="confirm-cancel"),
    ]

    def __init__(self, question: str, detail: str = "") -> None:
        super().__init__()
        self.question = question
        self.detail = detail

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, id="question", markup=False)
            if self.detail:
                yield Label(self.detail, id="detail", markup=False)
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", id="yes", variant="warning")
                yield Button("No (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)
