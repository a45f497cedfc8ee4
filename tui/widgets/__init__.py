"""Console widgets: top bar with connection badge, per-model layer bar, memory/slot gauge."""

from tui.widgets.gauge import Gauge, gauge_text
from tui.widgets.layer_bar import LayerBar
from tui.widgets.palette import Palette
from tui.widgets.topbar import TopBar

__all__ = ["Gauge", "LayerBar", "Palette", "TopBar", "gauge_text"]
