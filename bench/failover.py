"""Failover benchmark: the stall a stream sees when the middle node holding it is killed or frozen.

Starts an entry node (layers 0-9), two copies of 10-19 and one of 20-29 (real processes,
real SmolLM2, float32 compute and wire so that the tokens can be compared exactly), streams a
greedy 64-token generation, and after token 10 sends the middle node that holds the session
SIGKILL (its port refuses at once) or SIGSTOP (its socket still accepts, nothing answers: the
entry's hop deadline and liveness probe must find it, ADR-0036). Over --runs runs per signal
it prints the medians of: the inter-token gap before the signal, the longest gap after it
(detection + new route + chunked replay + one decode step), and whether the tokens equal an
undisturbed run. A stopped node is resumed and killed by its PID after its run.

Usage: .venv/bin/python bench/failover.py [--runs 3] [--signals kill,stop]
"""

from __future__ import annotations

import argparse
import json
import signal
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
FLOAT32 = ("--dtype", "float32", "--wire-dtype", "float32")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
AT_TOKEN = 10


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


def two_live_middles(mesh: LocalMesh, serial: list[int]) -> None:
    """Start middle copies until two live ones are admitted and no dead one is still listed."""
    live = [p for p in mesh.procs if p.startswith("mid-")]
    for _ in range(2 - len(live)):
        serial[0] += 1
        mesh.start_node(f"mid-{serial[0]}", "--model", MODEL, "--shard-start", "10", "--shard-end", "19", *FLOAT32)

    def ready() -> bool:
        listed = {n["node_id"] for n in mesh.get("/v1/nodes")["nodes"] if n["node_id"].startswith("mid-")}
        segment = next(s for s in mesh.get(f"/v1/coverage/{MODEL}")["segments"] if s["start_layer"] <= 10 <= s["end_layer"])
        return listed <= set(mesh.procs) and segment["node_count"] >= 2
    mesh.wait(ready, 240, "two live middle copies")
    mesh.wait_routable(MODEL, 240)


def holding_middle(mesh: LocalMesh) -> str | None:
    for name in [p for p in mesh.procs if p.startswith("mid-")]:
        node = next(x for x in mesh.get("/v1/nodes")["nodes"] if x["node_id"] == name)
        if httpx.get(f"{node['endpoint']}/v1/health", timeout=5).json()["sessions"]:
            return name
    return None


def disturbed_run(mesh: LocalMesh, sig: int) -> tuple[list[int], list[float], str | None]:
    """One stream with ``sig`` sent to the holding middle node after token AT_TOKEN."""
    hit: list[str] = []

    def on_token(n):
        if n == AT_TOKEN and not hit:
            name = holding_middle(mesh)
            if name is not None:
                mesh.signal(name, sig)
                hit.append(name)

    try:
        ids, stamps = stream(mesh.url, on_token)
    finally:
        for name in hit:  # resume a stopped node and kill it by PID; a killed one is only reaped
            if sig == signal.SIGSTOP:
                mesh.signal(name, signal.SIGCONT)
            mesh.kill(name)
    return ids, stamps, hit[0] if hit else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--signals", default="kill,stop", help="comma-separated: kill (SIGKILL), stop (SIGSTOP)")
    args = ap.parse_args()
    names = [s.strip() for s in args.signals.split(",") if s.strip()]
    mesh = LocalMesh(Path(tempfile.mkdtemp(prefix="meshnet-failover-")), heartbeat_s=1.0)
    rows: dict[str, list[tuple[float, float, bool]]] = {n: [] for n in names}
    serial = [0]
    try:
        mesh.start_tracker(MODEL, node_timeout_s=5.0)
        mesh.start_node("entry", "--model", MODEL, "--shard-start", "0", "--shard-end", "9", *FLOAT32)
        mesh.start_node("tail", "--model", MODEL, "--shard-start", "20", "--shard-end", "29", *FLOAT32)
        two_live_middles(mesh, serial)
        expected, _ = stream(mesh.url)  # also warms up every process
        for run in range(args.runs):
            for name in names:
                two_live_middles(mesh, serial)
                got, stamps, hit = disturbed_run(mesh, SIGNALS[name])
                if hit is None:
                    print(f"run {run} {name}: no middle node held the session at token {AT_TOKEN}; skipped")
                    continue
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                # tokens already on the wire arrive after the signal too; the stall is the longest gap
                row = (statistics.median(gaps[:AT_TOKEN - 1]), max(gaps[AT_TOKEN - 1:]), got == expected)
                rows[name].append(row)
                print(f"run {run} {name} {hit}: gap before {row[0]:.3f} s, stall {row[1]:.3f} s, "
                      f"identical {row[2]}", flush=True)
    finally:
        mesh.stop()
    print(f"\nfailover benchmark — {MODEL}, float32, signal after token {AT_TOKEN}")
    for name, got in rows.items():
        if not got:
            continue
        print(f"SIG{name.upper()}: median of {len(got)} run(s): inter-token gap before "
              f"{statistics.median(r[0] for r in got):.3f} s; longest gap after (detect + reroute + replay + "
              f"step) {statistics.median(r[1] for r in got):.3f} s; tokens identical {sum(r[2] for r in got)}/{len(got)}")


if __name__ == "__main__":
    main()
