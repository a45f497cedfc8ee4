"""``meshnet traffic``: the data plane now (the tracker's ``GET /v1/traffic``, ADR-0046).

Three tables: per node the last minute's time to first token, time per output token, tokens/s
and batch sizes; the sessions in flight with their routes; the latest failovers. ``--json``
prints the tracker's answer as it is.
"""

from __future__ import annotations

import time

from rich.table import Table

from meshnet.cli.output import JsonOpt, UrlOpt, console, emit, run, tracker_url
from meshnet.client import TrackerClient
from meshnet.protocol.traffic import recent_summary

#: buckets the node table sums up (six buckets of 10 s: the last minute)
SUMMARY_BUCKETS = 6


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def route_text(route: list[dict]) -> str:
    """``n1[0-9] → n2[10-19]`` (layers inclusive)."""
    return " → ".join(f"{h['node_id']}[{h['start_layer']}-{h['end_layer']}]" for h in route)


def render(data: dict, now_s: float) -> None:
    """Print the three tables of a ``GET /v1/traffic`` answer (``now_s``: wall clock, for ages)."""
    nodes = Table("node", "entry/KV sessions", "TTFT", "TPOT", "tokens/s", "batch (mean/max)", "status",
                  title="last minute per node")
    entries: dict[str, int] = {}
    for s in data["sessions"]:
        entries[s["entry_node"]] = entries.get(s["entry_node"], 0) + 1
    for n in data["nodes"]:
        r = recent_summary(n["buckets"], SUMMARY_BUCKETS)
        batch = "-" if r["batch_size"] is None else f"{r['batch_size']:.2f}/{r['batch_size_max']}"
        nodes.add_row(n["node_id"], f"{entries.get(n['node_id'], 0)}/{n.get('kv_sessions', 0)}", _ms(r["ttft_s"]), _ms(r["tpot_s"]),
                      f"{r['tokens_per_s']:.1f}", batch, f"[red]{n['error']}[/]" if n["error"] else "ok")
    console.print(nodes)
    sessions = Table("session", "model", "route", "tokens", "age", "TTFT", "failovers", title="sessions in flight")
    for s in data["sessions"]:
        sessions.add_row(s["session_id"][:8], s["model"], route_text(s["route"]),
                         f"{s['prompt_tokens']}+{s['completion_tokens']}", f"{s['age_s']:.1f} s", _ms(s["ttft_s"]),
                         str(s["failovers"]))
    console.print(sessions)
    failovers = Table("when", "session", "entry", "failed", "layers", "replacement", "reason", title="failovers")
    for e in data["failovers"]:
        failovers.add_row(f"{max(0.0, now_s - e['at_s']):.0f} s ago", e["session_id"][:8], e["entry_node"],
                          e["failed_node"], f"{e['start_layer']}-{e['end_layer']}", ", ".join(e["replacement"]),
                          e["reason"])
    console.print(failovers)


def traffic(url: str = UrlOpt, as_json: bool = JsonOpt) -> None:
    """Show the data plane: sessions in flight and their routes, the last minute's TTFT/TPOT/batch sizes, failovers."""
    async def fetch() -> dict:
        async with TrackerClient(tracker_url(url), timeout_s=30.0) as client:
            return await client.traffic(buckets=SUMMARY_BUCKETS)

    emit(run(fetch()), as_json, lambda d: render(d, time.time()))
