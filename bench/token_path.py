"""Token path: which ``meshnet/`` files one decode token runs through on a three-hop mesh.

Three real node processes (entry 0-9, middle 10-19, tail 20-29, float32, 1 thread each) run
under ``bench/traced_meshnet.py``, which records every call into a ``meshnet/`` file. A streamed
chat goes straight to the entry; the client notes when each content chunk arrives. Printed:

  * the distinct files called between two content chunks of steady decode (the union over
    the three processes), per process and in all, and their count (issue 24's goal: <= 12);
  * the same for the first token (request sent -> first content chunk);
  * calls from a ``node/`` file into a ``gateway/`` file in the steady window (the goal: none).

Usage: .venv/bin/python bench/token_path.py [--tokens 24] [--steady 12] [--functions]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshnet.localmesh import LocalMesh  # noqa: E402

MODEL = "smollm2-135m-instruct"
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
NODES = {"entry": (0, 9), "middle": (10, 19), "tail": (20, 29)}


def chunk_times(url: str, tokens: int) -> tuple[float, list[float]]:
    """A greedy streamed chat at ``url``: (wall-clock time it was sent, arrival of each content chunk)."""
    body = {"model": MODEL, "messages": STORY, "max_tokens": tokens, "temperature": 0, "stream": True}
    arrivals, sent = [], time.time()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):  # not the role-only first chunk
                    arrivals.append(time.time())
    return sent, arrivals


def dumps(mesh: LocalMesh, trace_dir: Path) -> dict[str, list]:
    """Every node's recorded calls (SIGUSR1 asks each to write them; bounded wait of 60 s)."""
    out = {}
    for name, proc in mesh.procs.items():
        if name not in NODES:
            continue
        path = trace_dir / f"{proc.pid}.json"
        path.unlink(missing_ok=True)
        os.kill(proc.pid, signal.SIGUSR1)
        for _ in range(600):
            if path.exists():
                break
            time.sleep(0.1)
        out[name] = json.loads(path.read_text())
    return out


def files_in(events: dict[str, list], start: float, end: float) -> dict[str, list[str]]:
    """Per process, the distinct ``meshnet/`` files called between ``start`` and ``end`` (unix seconds)."""
    return {name: sorted({e[1] for e in calls if start <= e[0] <= end}) for name, calls in events.items()}


def upward_calls(events: dict[str, list], start: float, end: float) -> list[tuple[str, str]]:
    """``(caller, callee)`` pairs of a ``node/`` file calling a ``gateway/`` file in the window."""
    return sorted({(caller, callee) for calls in events.values() for t, callee, caller, _ in calls
                   if start <= t <= end and caller and caller.startswith("meshnet/node/")
                   and callee.startswith("meshnet/gateway/")})


def report(title: str, events: dict[str, list], start: float, end: float, functions: bool = False) -> None:
    per_node = files_in(events, start, end)
    union = sorted(set().union(*per_node.values()))
    print(f"\n{title}: {len(union)} distinct meshnet/ files over the three processes ({end - start:.3f} s window)")
    for name, files in per_node.items():
        print(f"  {name:7s} {len(files):2d}: {' '.join(files)}")
    print(f"  all    {len(union):2d}: {' '.join(union)}")
    if functions:
        called = sorted({(e[1], e[3]) for calls in events.values() for e in calls if start <= e[0] <= end})
        for file in union:
            print(f"    {file}: {', '.join(f for name, f in called if name == file)}")
    upward = upward_calls(events, start, end)
    print(f"  node/ -> gateway/ calls: {len(upward)}" + "".join(f"\n    {a} -> {b}" for a, b in upward))


def trace(tokens: int) -> tuple[dict[str, list], float, list[float]]:
    """Start the traced three-node mesh, run a warm-up chat and one of ``tokens`` tokens, stop
    everything; returns every node's recorded calls, when the chat was sent and when each of its
    content chunks arrived (unix seconds)."""
    with tempfile.TemporaryDirectory(prefix="meshnet-token-path-") as tmp:
        trace_dir = Path(tmp)
        # heartbeats every 5 s: a token's window (tens of ms) rarely holds one
        mesh = LocalMesh(trace_dir / "logs", heartbeat_s=5.0, env={"MESHNET_TRACE_DIR": str(trace_dir)})
        try:
            mesh.start_tracker(MODEL)
            for name, (start, end) in NODES.items():
                mesh.start_node(name, "--model", MODEL, "--shard-start", str(start), "--shard-end", str(end),
                                "--dtype", "float32", "--wire-dtype", "float32", "--spot-check-rate", "0",
                                module="bench.traced_meshnet")
            mesh.wait_routable(MODEL, 600)
            entry = next(n["endpoint"] for n in mesh.get("/v1/nodes")["nodes"] if n["node_id"] == "entry")
            chunk_times(entry, 4)  # warm: connections, first-call costs
            sent, arrivals = chunk_times(entry, tokens)
            return dumps(mesh, trace_dir), sent, arrivals
        finally:
            mesh.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--steady", type=int, default=12, help="the steady window ends at this content chunk")
    ap.add_argument("--functions", action="store_true", help="also list the functions called in each file")
    args = ap.parse_args()
    events, sent, arrivals = trace(args.tokens)
    print(f"meshnet token path: {MODEL}, 3 hops, float32, {len(arrivals)} content chunks")
    report(f"steady decode token (between content chunks {args.steady} and {args.steady + 1})", events,
           arrivals[args.steady - 1], arrivals[args.steady], args.functions)
    report("first token (request sent -> first content chunk)", events, sent, arrivals[0])


if __name__ == "__main__":
    main()
