"""One output sink for the CLI: human (Rich) or ``--json``, errors to stderr in one place."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any, Callable

import typer
from rich.console import Console
from rich.markup import escape

from meshnet.errors import MeshnetError

console = Console()
err_console = Console(stderr=True)

JsonOpt = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")
UrlOpt = typer.Option(None, "--url", envvar="MESHNET_URL",
                      help="Tracker URL (default: http://127.0.0.1:8700, env MESHNET_URL); several separated by "
                           "commas: the next is tried when one does not answer.")
TokenOpt = typer.Option(None, "--token", envvar="MESHNET_OPERATOR_TOKEN", help="Operator token for mutating calls.")

DEFAULT_URL = "http://127.0.0.1:8700"


def tracker_url(url: str | None) -> str:
    """``--url`` (or the default) checked as base URLs, comma-separated as given (every tracker of
    one database); a bad one (e.g. an unbracketed IPv6 address) exits 1 with the reason and a
    hint instead of failing later with a traceback."""
    return ",".join(tracker_urls(url))


def tracker_urls(url: str | None) -> list[str]:
    """:func:`tracker_url` as a list, in the order given."""
    from meshnet.endpoints import check_endpoints

    try:
        return check_endpoints(url or DEFAULT_URL)
    except MeshnetError as exc:
        fail(exc)


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """Print ``data`` as JSON (``--json``) or through the ``human`` renderer."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        human(data)


def report(exc: MeshnetError) -> None:
    """Print a MeshnetError (message and hint) to stderr; each stays one line (``soft_wrap``: the
    terminal wraps it, Rich does not cut it into several)."""
    err_console.print(f"[bold red]error:[/] {escape(exc.message)}", soft_wrap=True, highlight=False)
    if exc.hint:
        err_console.print(f"[dim]hint: {escape(exc.hint)}[/]", soft_wrap=True, highlight=False)


def fail(exc: MeshnetError) -> None:
    """:func:`report` ``exc`` and exit 1 (inside a command)."""
    report(exc)
    raise typer.Exit(1)


def run(coro) -> Any:
    """Run a coroutine, turning MeshnetError into a clean CLI failure."""
    try:
        return asyncio.run(coro)
    except MeshnetError as exc:
        fail(exc)


def setup_logging(level: str | None = None) -> None:
    """Configure logging once (``--log-level`` or ``MESHNET_LOG_LEVEL``; default INFO)."""
    level = (level or os.environ.get("MESHNET_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def human_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
