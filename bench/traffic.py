"""Traffic view cost (ADR-0046): what a node's and the tracker's ``GET /v1/traffic`` cost.

- node: building one answer (60 buckets with TTFT/TPOT/tokens observed in each, a full batch-size
  deque of 4,096 samples, ``--sessions`` sessions in flight, 100 failover events), median of
  ``--runs`` builds, and the answer's JSON size;
- tracker: gathering ``--nodes`` such answers over an in-process transport (no sockets: the
  figure is the tracker's own work: parse, validate, merge), median of ``--runs`` gatherings,
  and the merged answer's JSON size.

Usage: .venv/bin/python bench/traffic.py [--nodes 100] [--sessions 8] [--runs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshnet.gateway.pipeline import GenerationStats  # noqa: E402
from meshnet.gateway.traffic import TrafficLog  # noqa: E402
from meshnet.layers import LayerRange  # noqa: E402
from meshnet.node.metrics import NodeMetrics  # noqa: E402
from meshnet.protocol.route import Hop  # noqa: E402
from meshnet.protocol.traffic import NodeTraffic  # noqa: E402
from meshnet.tracker.traffic import TrafficGatherer, last_buckets  # noqa: E402


def busy_node(node_id: str, sessions: int) -> tuple[NodeMetrics, collections.deque, TrafficLog]:
    """A node's metrics, batch sizes and traffic log as after ten busy minutes."""
    now = time.time()
    metrics = NodeMetrics()
    for i in range(600):
        metrics.clock = lambda t=now - 600 + i: t
        metrics.first_token(0.3)
        metrics.observe_forward(1, 0.02, 100)
        metrics.generation_started()
        metrics.generation_finished(GenerationStats(prompt_tokens=50, completion_tokens=64, decode_s=3.0))
    metrics.clock = time.time
    mono = time.monotonic()
    sizes = collections.deque(((mono - 600 + i * 600 / 4096, 1 + i % 8) for i in range(4096)), maxlen=4096)
    log = TrafficLog(node_id)
    route = [Hop(node_id, "http://e", LayerRange(0, 10)), Hop("b", "http://b", LayerRange(10, 20)),
             Hop("c", "http://c", LayerRange(20, 30))]
    for i in range(sessions):
        log.session_started(f"{node_id}-s{i}", "smollm2-135m", GenerationStats(prompt_tokens=120,
                                                                                completion_tokens=30), lambda: route)
    for i in range(100):
        log.failover(f"{node_id}-s{i}", route[1], [Hop("d", "http://d", LayerRange(10, 20))],
                     "hop b at http://b (layers 10-19) missed its 0.50 s deadline on 1 token(s) (frozen)")
    return metrics, sizes, log


def node_answer(node_id: str, metrics: NodeMetrics, sizes, log: TrafficLog) -> NodeTraffic:
    now = time.time()
    return NodeTraffic(node_id=node_id, at_s=now, buckets=metrics.traffic_buckets(sizes, now_s=now),
                       sessions=log.sessions(), kv_sessions=len(log), failovers=log.failovers())


async def gather(nodes: int, body: dict, runs: int) -> tuple[float, int, int]:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={**body, "node_id": request.url.host})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        endpoints = [(f"n{i}", f"http://n{i}") for i in range(nodes)]
        gatherer = TrafficGatherer(lambda: http, lambda: endpoints, cache_s=0.0)
        times, size = [], 0
        for _ in range(runs):
            t0 = time.perf_counter()
            merged = await gatherer.traffic()
            times.append(time.perf_counter() - t0)
            size = len(json.dumps(merged.model_dump()))
        return statistics.median(times), size, len(json.dumps(last_buckets(merged, 12).model_dump()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    metrics, sizes, log = busy_node("n0", args.sessions)
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        answer = node_answer("n0", metrics, sizes, log)
        body = answer.model_dump()
        json.dumps(body)
        times.append(time.perf_counter() - t0)
    node_bytes = len(json.dumps(body))
    print(f"node GET /v1/traffic: {statistics.median(times) * 1000:.2f} ms to build (median of {args.runs}), "
          f"{node_bytes} bytes of JSON ({len(answer.buckets)} buckets, {len(answer.sessions)} sessions, "
          f"{len(answer.failovers)} failovers, {len(sizes)} batch-size samples)")
    median_s, merged_bytes, console_bytes = asyncio.run(gather(args.nodes, body, args.runs))
    print(f"tracker GET /v1/traffic over {args.nodes} nodes: {median_s * 1000:.1f} ms to gather and merge "
          f"(median of {args.runs}, in-process transport), {merged_bytes} bytes of JSON, "
          f"{console_bytes} with ?buckets=12 (the console's)")


if __name__ == "__main__":
    main()
