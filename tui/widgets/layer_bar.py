"""Layer bar: one model's coverage drawn as a row of cells, one per layer.

Each cell shows how many admitted nodes serve that layer. Gaps (no node) are drawn in
the theme's error colour so they stand out; covered layers are shaded by redundancy
(1 node lighter, 3+ nodes full). When a model has more layers than the bar has room
for, a cell spans several layers and shows their minimum, so a gap is never hidden.
The line below is the layer axis.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widget import Widget

from tui.format import bar_cells
from tui.widgets.palette import Palette


#: widest cell: a 4-layer model should not stretch across the whole screen
MAX_CELL_WIDTH = 12


def _axis(cells: Sequence[tuple[int, int, int]], cell_width: int) -> str:
    """Layer numbers under the cells, placed greedily so they never overlap.

    A one-layer cell gets its layer centred under it; a cell spanning several layers gets
    its first layer at its left edge, and the very last layer is right-aligned.
    """
    total = len(cells) * cell_width
    line = [" "] * total
    free_from = 0
    for i, (first, last, _count) in enumerate(cells):
        pos = i * cell_width
        if first == last:
            label = str(first)
            pos += max(0, (cell_width - len(label)) // 2)
        elif i == len(cells) - 1:
            label = str(last)
            pos = total - len(label)
        else:
            label = str(first)
        if pos >= free_from and pos + len(label) <= total:
            line[pos:pos + len(label)] = label
            free_from = pos + len(label) + 1
    return "".join(line)


def render_bar(counts: Sequence[int], width: int, palette: Palette) -> Text:
    """Two lines (cells, axis) at most ``width`` wide."""
    if not counts or width <= 0:
        return Text("no layers known", style=palette.muted)
    cells = bar_cells(counts, width)
    cell_width = max(1, min(MAX_CELL_WIDTH, width // len(cells)))
    text = Text()
    for _first, _last, count in cells:
        if count == 0:
            style = f"bold {palette.foreground} on {palette.bad}"
        else:
            style = f"bold {palette.background} on {palette.shade(palette.ok, 0.45 + 0.2 * min(count, 3))}"
        label = str(count) if count < 10 else "+"
        text.append(label.center(cell_width) if cell_width > 1 else label, style=style)
    text.append("\n")
    text.append(_axis(cells, cell_width), style=palette.muted)
    return text


class LayerBar(Widget):
    """The bar of one model; call :meth:`set_counts` with the per-layer node counts."""

    DEFAULT_CSS = """
    LayerBar { height: 2; width: 1fr; }
    """

    def __init__(self, counts: Sequence[int] = (), *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.counts = list(counts)

    def set_counts(self, counts: Sequence[int]) -> None:
        if list(counts) != self.counts:
            self.counts = list(counts)
            self.refresh()

    def render(self) -> Text:
        return render_bar(self.counts, self.size.width, Palette.of(self.app))
