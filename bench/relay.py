"""Relay benchmark (ADR-0045): decode tokens/s of a 3-hop SmolLM2 chat whose middle hop is reached
directly, then through the tracker's relay.

Starts a tracker, an entry node (layers 0-9), a last node (20-29) and a direct middle node
(10-19), all real processes on 127.0.0.1 with float32 compute and wire; runs --runs greedy chats
of --tokens tokens and takes the decode tokens/s the entry measures (``meshnet.decode_tokens_per_s``);
then stops the direct middle node, starts one with ``--relay`` (its hop goes caller → tracker →
tunnel → node) and runs the same chats. Prints the median and every run of each, the per-token
difference in milliseconds, and whether the tokens were equal. Then the relay's own cost per call,
with less noise than decode rates on a busy machine: the median round trip of --calls
``GET /v1/health`` calls to the relayed node through the relay and straight to its listener.
Every process is stopped by its PID.

Usage: .venv/bin/python bench/relay.py [--runs 5] [--tokens 48] [--threads 1] [--calls 300]
"""

from __future__ import annotations

import argparse
import re
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


def shard(start: int, end: int) -> list[str]:
    return ["--model", MODEL, "--shard-start", str(start), "--shard-end", str(end), *FLOAT32]


def wait_middle(mesh: LocalMesh, node_id: str) -> None:
    def check():
        hops = mesh.get("/v1/route", params={"model": MODEL})["hops"]
        return any(h["node_id"] == node_id and h["start_layer"] == 10 for h in hops)
    mesh.wait(check, 300, f"layers 10-19 on {node_id}")


def runs(mesh: LocalMesh, n: int, tokens: int) -> tuple[list[float], list[int], str]:
    rates, ids, endpoint = [], [], ""
    for _ in range(n):
        resp = httpx.post(f"{mesh.url}/v1/chat/completions", timeout=600, json={
            "model": MODEL, "messages": STORY, "max_tokens": tokens, "temperature": 0})
        resp.raise_for_status()
        data = resp.json()["meshnet"]
        rates.append(data["decode_tokens_per_s"])
        ids, endpoint = data["completion_token_ids"], data["route"][1]["endpoint"]
    return rates, ids, endpoint


def round_trip_ms(url: str, calls: int) -> float:
    """Median milliseconds of ``calls`` sequential ``GET url`` on one kept-alive connection."""
    times = []
    with httpx.Client(timeout=30) as http:
        http.get(url).raise_for_status()
        for _ in range(calls):
            t0 = time.perf_counter()
            http.get(url).raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--calls", type=int, default=300, help="health calls per path for the round trip")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalMesh(Path(tmp)) as mesh:
        mesh.start_tracker(MODEL)
        mesh.start_node("node-0", *shard(0, 9), threads=args.threads)
        mesh.start_node("node-2", *shard(20, 29), threads=args.threads)
        mesh.start_node("node-1d", *shard(10, 19), threads=args.threads)
        wait_middle(mesh, "node-1d")
        runs(mesh, 1, 8)  # warm-up
        direct, direct_ids, direct_endpoint = runs(mesh, args.runs, args.tokens)
        mesh.kill("node-1d")
        mesh.start_node("node-1", *shard(10, 19), "--relay", threads=args.threads)
        wait_middle(mesh, "node-1")
        time.sleep(1.0)
        runs(mesh, 1, 8)
        relayed, relayed_ids, relayed_endpoint = runs(mesh, args.runs, args.tokens)
        listener = re.search(r"listening on (\S+)", (Path(tmp) / "node-1.log").read_text()).group(1)
        via_relay_ms = round_trip_ms(f"{relayed_endpoint}/v1/health", args.calls)
        straight_ms = round_trip_ms(f"{listener}/v1/health", args.calls)
    d, r = statistics.median(direct), statistics.median(relayed)
    print(f"middle hop direct  ({direct_endpoint}): decode {d:.2f} tok/s median of {args.runs} "
          f"({', '.join(f'{x:.2f}' for x in direct)})")
    print(f"middle hop relayed ({relayed_endpoint}): decode {r:.2f} tok/s median of {args.runs} "
          f"({', '.join(f'{x:.2f}' for x in relayed)})")
    print(f"relay cost per token: {1000 / r - 1000 / d:+.2f} ms ({(r / d - 1) * 100:+.1f} % tokens/s); "
          f"tokens equal: {relayed_ids == direct_ids}")
    print(f"GET /v1/health round trip, median of {args.calls}: through the relay {via_relay_ms:.2f} ms, "
          f"straight {straight_ms:.2f} ms: the relay adds {via_relay_ms - straight_ms:.2f} ms per call")


if __name__ == "__main__":
    main()
