"""Failover benchmark: time from a SIGKILL of the active middle node to the next token.

Starts an entry node (layers 0-9), two copies of 10-19 and one of 20-29 (real processes,
real SmolLM2), streams a greedy 64-token generation, kills the middle node that holds the
session after token 10, and prints, over --runs runs: the median inter-token gap before the
kill, the longest gap after it (detection + new route + replay + one decode step), and
whether the tokens equal an undisturbed run.

Usage: .venv/bin/python bench/failover.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def stream(url: str, on_token=None) -> tuple[list[int], list[float]]:
    body = {"model": MODEL, "messages": STORY, "max_tokens": 64, "temperature": 0, "stream": True}
    stamps, ids = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"generation failed: {chunk['error']}")
            if chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.monotonic())
                if on_token:
                    on_token(len(stamps))
            if chunk.get("meshnet"):
                ids = chunk["meshnet"]["completion_token_ids"]
    return ids, stamps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    mesh = LocalMesh(Path(tempfile.mkdtemp(prefix="meshnet-failover-")), heartbeat_s=1.0)
    rows = []
    try:
        mesh.start_tracker(MODEL, node_timeout_s=5.0)
        mesh.start_node("entry", "--model", MODEL, "--shard-start", "0", "--shard-end", "9")
        mesh.start_node("tail", "--model", MODEL, "--shard-start", "20", "--shard-end", "29")
        for run in range(args.runs + 1):
            for name in (f"mid-a{run}", f"mid-b{run}"):
                if name not in mesh.procs:
                    mesh.start_node(name, "--model", MODEL, "--shard-start", "10", "--shard-end", "19")
            mesh.wait(lambda: next(s for s in mesh.get(f"/v1/coverage/{MODEL}")["segments"]
                                   if s["start_layer"] <= 10 <= s["end_layer"])["node_count"] >= 2, 240,
                      "two middle copies")
            mesh.wait_routable(MODEL, 240)
            expected, _ = stream(mesh.url)
            killed = []

            def on_token(n):
                if n == 10 and not killed:
                    for name in [p for p in mesh.procs if p.startswith("mid-")]:
                        node = next(x for x in mesh.get("/v1/nodes")["nodes"] if x["node_id"] == name)
                        if httpx.get(f"{node['endpoint']}/v1/health", timeout=5).json()["sessions"]:
                            mesh.kill(name)
                            killed.append(time.monotonic())
                            return

            got, stamps = stream(mesh.url, on_token)
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            # tokens already on the wire arrive after the kill too; the stall is the longest gap
            stall = max(gaps[9:]) if killed else float("nan")
            rows.append((statistics.median(gaps[:9]), stall, got == expected))
            for name in [p for p in mesh.procs if p.startswith("mid-")]:
                mesh.kill(name)
    finally:
        mesh.stop()
    rows = rows[1:]  # the first run warms up caches
    print(f"\nfailover benchmark — {MODEL}, median of {len(rows)} run(s)")
    print(f"median inter-token gap before the kill: {statistics.median(r[0] for r in rows):.3f} s")
    print(f"longest gap after the kill (detect + reroute + replay + step): "
          f"{statistics.median(r[1] for r in rows):.3f} s")
    print(f"tokens identical to the undisturbed run: {sum(r[2] for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    main()
