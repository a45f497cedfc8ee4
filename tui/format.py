"""Text helpers for the console: ages, sizes, sparklines, per-layer coverage counts.

Pure functions over plain data (no textual import), so they are table-tested in
``tests/tui/test_state.py``. Ages are rendered coarsely on purpose: an operator needs
"42 s" or "17 min", not milliseconds, and coarse buckets keep snapshot tests stable.
"""

from __future__ import annotations

from collections.abc import Sequence

SPARK_CHARS = "▁▂▃▄▅▆▇█"
NO_VALUE = "—"


def format_age(seconds: float | None) -> str:
    """``12 s``, ``17 min``, ``3 h``, ``2 d``; ``—`` for unknown; negative (clock skew) counts as ``0 s``."""
    if seconds is None:
        return NO_VALUE
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{int(s)} s"
    if s < 3600:
        return f"{int(s // 60)} min"
    if s < 86400:
        return f"{int(s // 3600)} h"
    return f"{int(s // 86400)} d"


def format_bytes(n: float | None) -> str:
    """Binary units with one decimal: ``56.2 KiB``, ``1.5 GiB``."""
    if n is None:
        return NO_VALUE
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bytes_short(n: float | None) -> str:
    """Compact form for table cells: ``512B``, ``112K``, ``1.6G`` (binary units)."""
    if n is None:
        return NO_VALUE
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(value) < 1024 or unit == "T":
            return f"{int(value)}{unit}" if unit == "B" or value >= 100 else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(value: float | None, digits: int = 1) -> str:
    return NO_VALUE if value is None else f"{value:.{digits}f}"


def spark(values: Sequence[float], width: int = 12) -> str:
    """The last ``width`` values as block characters scaled between their min and max.

    A flat series is drawn at mid height (or at the bottom when it is all zero), so a
    steady node does not look like it is at either extreme.
    """
    tail = [float(v) for v in values][-width:]
    if not tail:
        return ""
    low, high = min(tail), max(tail)
    if high == low:
        return (SPARK_CHARS[3] if high > 0 else SPARK_CHARS[0]) * len(tail)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round((v - low) / (high - low) * top)] for v in tail)


def layer_counts(coverage: dict) -> list[int]:
    """Expand a coverage map's segments (``end_layer`` inclusive) to one node count per layer."""
    counts = [0] * int(coverage.get("num_layers") or 0)
    for seg in coverage.get("segments", []):
        for layer in range(seg["start_layer"], seg["end_layer"] + 1):
            if 0 <= layer < len(counts):
                counts[layer] = seg["node_count"]
    return counts


def gap_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Inclusive ``(start, end)`` runs of layers with no node."""
    gaps, start = [], None
    for layer, count in enumerate(list(counts) + [1]):
        if count == 0 and start is None:
            start = layer
        elif count != 0 and start is not None:
            gaps.append((start, layer - 1))
            start = None
    return gaps


def format_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def bar_cells(counts: Sequence[int], width: int) -> list[tuple[int, int, int]]:
    """Split ``counts`` into at most ``width`` cells ``(first_layer, last_layer, min_count)``.

    With room to spare every layer gets its own cell; otherwise several layers share a
    cell showing their *minimum* count, so a gap anywhere inside it still shows as a gap.
    """
    n = len(counts)
    if n == 0 or width <= 0:
        return []
    cells = min(n, width)
    out = []
    for i in range(cells):
        first, last = i * n // cells, (i + 1) * n // cells - 1
        out.append((first, last, min(counts[first:last + 1])))
    return out


def format_ms(seconds: float | None) -> str:
    """``250 ms`` (``1.2 s`` from 10 s); ``—`` for unknown."""
    if seconds is None:
        return NO_VALUE
    return f"{seconds:.1f} s" if seconds >= 10 else f"{seconds * 1000:.0f} ms"


def bucket_series(buckets: Sequence[dict], key: str, width: int) -> list[float]:
    """The last ``width`` values of ``key`` across traffic buckets (oldest first), an empty
    bucket (None) as 0.0, for :func:`spark`."""
    return [float(b.get(key) or 0.0) for b in list(buckets)[-width:]]


def route_text(route: Sequence[dict]) -> str:
    """``n1 0-9 → n2 10-19`` (layers inclusive, like the API)."""
    return " → ".join(f"{h['node_id']} {h['start_layer']}-{h['end_layer']}" for h in route)
