"""Colours from the active Textual theme, as hex strings usable in Rich styles.

Views build Rich ``Text`` for table cells and bars; taking the colours from the theme
(not hard-coded) keeps them right under ``--theme``.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import App
from textual.color import Color


def _hex(variables: dict[str, str], name: str, fallback: str) -> Color:
    try:
        return Color.parse(variables.get(name) or fallback)
    except Exception:  # noqa: BLE001 - a theme without the variable falls back
        return Color.parse(fallback)


@dataclass(frozen=True)
class Palette:
    """The handful of colours the console uses."""

    ok: str
    bad: str
    warn: str
    accent: str
    muted: str
    foreground: str
    background: str

    @classmethod
    def of(cls, app: App) -> "Palette":
        v = app.theme_variables or app.get_css_variables()
        fg = _hex(v, "foreground", "#e0e0e0")
        bg = _hex(v, "background", "#121212")
        return cls(ok=_hex(v, "success", "#4ebf71").hex, bad=_hex(v, "error", "#ba3c5b").hex,
                   warn=_hex(v, "warning", "#ffa62b").hex, accent=_hex(v, "accent", "#ffa62b").hex,
                   muted=fg.blend(bg, 0.45).hex, foreground=fg.hex, background=bg.hex)

    def shade(self, colour: str, strength: float) -> str:
        """``colour`` blended towards the background; ``strength`` 1.0 is the full colour."""
        return Color.parse(self.background).blend(Color.parse(colour), max(0.0, min(1.0, strength))).hex
