"""``meshnet node timings``: what this host's node processes measured and keep (ADR-0048, ADR-0044)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from meshnet.cli.output import JsonOpt, console, emit, fail
from meshnet.errors import MeshnetError


def _files() -> list[Path]:
    from meshnet.models.hosttimings import default_path
    from meshnet.node.calibration import default_cache_file

    return [p for p in (default_path(), default_cache_file()) if p is not None]


def timings(clear: bool = typer.Option(False, "--clear", help="Forget them all: the next node (or `meshnet serve`) "
                                       "on this host measures again."),
            as_json: bool = JsonOpt) -> None:
    """Show what this host's nodes measured and keep for a week: weight layouts, the float32
    crossover, the attention path and the compute-dtype calibration, by dtype, shape and threads."""
    from meshnet.models.hosttimings import entries, host_id

    files = _files()
    rows = entries(files)
    if clear:
        for path in files:
            try:
                if path.is_file():
                    path.unlink()
            except OSError as exc:
                fail(MeshnetError(f"could not clear {path}: {exc}", hint="delete the file by hand"))

    def human(data: dict) -> None:
        table = Table("kind", "what", "value", "age", title=f"kept timings of {data['host']}")
        for r in data["timings"]:
            what = r["what"].split(" of ")[0].split(" layouts ")[0]  # the layouts on offer: --json has them
            value = _shown(r["kind"], r["value"])
            age = ("?" if r["age_s"] is None else f"{r['age_s'] / 3600:.1f} h") + (" (expired)" if r["expired"] else "")
            table.add_row(r["kind"], what, value, age)
        console.print(table if data["timings"] else "no timings kept for this host yet")
        console.print(f"files: {', '.join(data['files'])}" + ("  [yellow]cleared[/]" if data["cleared"] else ""))

    emit({"host": host_id(), "files": [str(p) for p in files], "timings": rows, "cleared": clear}, as_json, human)


def _shown(kind: str, value: object) -> str:
    """A kept value as the table shows it."""
    if kind == "calibration":
        return _speeds(value)
    if kind == "min_rows":
        return "never: half precision" if value is None else f"from {value} rows"
    if kind == "attention in float32" and isinstance(value, bool):
        return "float32" if value else "half precision"
    return str(value)


def _speeds(samples) -> str:
    """A calibration's samples as ``dtype a / b tok/s`` (best over thread counts, at each session
    count), one dtype per line."""
    best: dict[str, dict[int, float]] = {}
    for sample in samples if isinstance(samples, list) else []:
        try:
            dtype, sessions, speed = str(sample["dtype"]), int(sample.get("sessions", 1)), float(sample["tokens_per_s"])
        except (TypeError, KeyError, ValueError, AttributeError):  # a damaged entry: shown as such
            continue
        by_sessions = best.setdefault(dtype, {})
        by_sessions[sessions] = max(by_sessions.get(sessions, 0.0), speed)
    return "\n".join(f"{dtype} " + " / ".join(f"{v:.0f}" for _, v in sorted(by.items())) + " tok/s"
                     for dtype, by in sorted(best.items())) or "no samples"

