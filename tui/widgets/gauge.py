"""A horizontal gauge (memory budget, shard slots): as Rich text for table cells, or a widget.

Colour follows the fill: success below 70 %, warning below 90 %, error from 90 %.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from tui.widgets.palette import Palette

FILLED, EMPTY = "▰", "▱"


def _fraction(used: float, total: float) -> float:
    return 0.0 if total <= 0 else max(0.0, min(1.0, used / total))


def gauge_text(used: float, total: float, width: int, palette: Palette, label: str = "") -> Text:
    """``▰▰▰▱▱▱ label``: ``width`` cells filled in proportion to ``used / total``."""
    frac = _fraction(used, total)
    filled = round(frac * width)
    if used > 0 and filled == 0:
        filled = 1  # something is used: never draw an empty gauge
    colour = palette.ok if frac < 0.7 else palette.warn if frac < 0.9 else palette.bad
    text = Text()
    text.append(FILLED * filled, style=colour)
    text.append(EMPTY * (width - filled), style=palette.muted)
    if label:
        text.append(f" {label}")
    return text


class Gauge(Widget):
    """One-line gauge with a title and a label, e.g. ``memory ▰▰▱▱▱▱ 1.2/6.4 GiB``."""

    DEFAULT_CSS = """
    Gauge { height: 1; width: 1fr; }
    """

    def __init__(self, title: str, *, bar_width: int = 20, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self.bar_width = bar_width
        self._used, self._total, self._label = 0.0, 0.0, ""

    def set_value(self, used: float, total: float, label: str) -> None:
        self._used, self._total, self._label = used, total, label
        self.refresh()

    def render(self) -> Text:
        text = Text()
        text.append(f"{self.title:<8}", style="bold")
        text.append_text(gauge_text(self._used, self._total, self.bar_width, Palette.of(self.app), self._label))
        return text
