"""Benchmark of the tracker's heartbeat path at network scale (ADR-0037, ADR-0043).

An in-process tracker app (:func:`meshnet.tracker.app.build_app`, no control loop) served through
``httpx.ASGITransport``: no sockets. Its store is, per backend, sqlite on disk in a temporary
directory or a fresh PostgreSQL database (the server of ``MESHNET_BENCH_PG``, default
``postgresql://postgres@127.0.0.1:5432/test``, dropped afterwards). Beside it runs the part of the
control loop that touches the store every second whatever happens: the sync round
(:class:`meshnet.tracker.sharing.Sharing`: leadership; on PostgreSQL the batched write of
heartbeat times and the read of other trackers' changes). ``N`` simulated
nodes, each with its own Ed25519 key, register (signed, with the protocol revision, probed through
a fake transport) and then heartbeat, signed, at the interval the tracker announced to them.

Each node heartbeats at a random phase within its interval, so the offered rate is
``N / interval``, as in a real network. Time is not scaled: the run lasts ``WINDOW_S`` seconds of
real time (or one interval when that is shorter), so only the nodes whose phase falls within the
window send (at 10,000 nodes and a 20 s interval, three quarters of them: 7,500 heartbeats).
A heartbeat's latency runs from its scheduled time to its answer, so time spent waiting for a busy
event loop (the client and the tracker share it, as a saturated tracker's queue would) counts.

Printed per size: the announced interval and timeout, the offered and served rates, p50 / p99 /
max heartbeat latency, and the longest the event loop went without serving anyone while the nodes
heartbeat (:mod:`bench.looplag`).
Run: ``.venv/bin/python bench/heartbeats.py [N ...] [sqlite|postgresql] [--runs=3]`` (default 1,000
and 10,000 on both backends; about two minutes per backend on two CPU cores, most of it registering
the nodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from asgi_lifespan import LifespanManager  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from bench.looplag import LoopLag, log_as_served  # noqa: E402
from meshnet.client import NodeSigner  # noqa: E402
from meshnet.protocol.control import (PROTOCOL_REVISION, HeartbeatRequest, NodeStats,  # noqa: E402
                                      RegisterRequest)
from meshnet.protocol.signing import encode_public_key  # noqa: E402
from meshnet.tracker.app import build_app  # noqa: E402
from meshnet.tracker.heap import HeapFreezer  # noqa: E402
from meshnet.tracker.service import TrackerSettings  # noqa: E402
from meshnet.tracker.sharing import Sharing  # noqa: E402

SIZES = (1_000, 10_000)
#: longest real time heartbeats are sent for, per size, seconds
WINDOW_S = 15.0
#: registrations in flight at once while the network is built
REGISTER_CONCURRENCY = 64


def healthy_nodes(request: httpx.Request) -> httpx.Response:
    """The tracker's outbound transport: every simulated node answers its reachability probe."""
    return httpx.Response(200, json={"status": "ok"})


def percentile(sorted_values: list[float], share: float) -> float:
    """The value below which ``share`` of ``sorted_values`` lie (nearest rank)."""
    return sorted_values[min(len(sorted_values) - 1, int(share * len(sorted_values)))]


async def register_all(client: httpx.AsyncClient, count: int) -> tuple[list[NodeSigner], float]:
    """Register ``count`` nodes, each with a fresh key; returns their signers and the last
    announced interval, seconds."""
    signers = [NodeSigner(f"sim-{k:05d}", Ed25519PrivateKey.generate()) for k in range(count)]
    gate = asyncio.Semaphore(REGISTER_CONCURRENCY)
    intervals: list[float] = []

    async def register(signer: NodeSigner) -> None:
        body = RegisterRequest(protocol=PROTOCOL_REVISION, node_id=signer.node_id,
                               public_key=encode_public_key(signer.key.public_key()),
                               endpoint=f"http://{signer.node_id}.test:8000", benchmark_tokens_per_sec=20.0)
        async with gate:
            resp = await client.post("/v1/nodes/register", json=body.model_dump(mode="json"), auth=signer)
        resp.raise_for_status()
        intervals.append(resp.json()["heartbeat_interval_s"])

    await asyncio.gather(*(register(s) for s in signers))
    return signers, max(intervals)


async def heartbeat_window(client: httpx.AsyncClient, signers: list[NodeSigner], interval_s: float,
                           rng: random.Random, lag: LoopLag) -> tuple[list[float], float, set[float]]:
    """Each node heartbeats once at a random phase within ``interval_s``; those within the window
    send. Returns latencies (s), the window's length (s) and the intervals the answers announced.
    ``lag`` probes the loop from the moment every simulated node's task exists: making thousands of
    client tasks at once is the bench's own block, not the tracker's (it was the longest one)."""
    window_s = min(WINDOW_S, interval_s)
    body = HeartbeatRequest(stats=NodeStats(tokens_per_s=20.0)).model_dump_json().encode()
    headers = {"content-type": "application/json"}
    latencies: list[float] = []
    announced: set[float] = set()
    start = time.perf_counter() + 1.0  # after every task is made and the probe runs

    async def beat(signer: NodeSigner, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        resp = await client.post(f"/v1/nodes/{signer.node_id}/heartbeat", content=body, headers=headers,
                                 auth=signer)
        latencies.append(time.perf_counter() - at)
        resp.raise_for_status()
        announced.add(resp.json()["heartbeat_interval_s"])

    phases = [(s, rng.uniform(0.0, interval_s)) for s in signers]
    beats = [asyncio.create_task(beat(s, start + phase)) for s, phase in phases if phase < window_s]
    async with lag:
        await asyncio.gather(*beats)
    return latencies, window_s, announced


#: the PostgreSQL server a scratch database is made on
PG_SERVER = os.environ.get("MESHNET_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
BACKENDS = ("sqlite", "postgresql")


@contextlib.contextmanager
def database(backend: str):
    """A fresh ``--db`` of ``backend`` for the block."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield f"{tmp}/tracker.db"
    else:
        from meshnet.tracker.pgstore import scratch_database
        with scratch_database(PG_SERVER, prefix="meshnet_bench") as url:
            yield url


async def sync_every_second(sharing: Sharing) -> None:
    """The control loop's work that runs whatever happens (no probes, no rebalance): the sync round
    and the heap's freeze (ADR-0059)."""
    heap = HeapFreezer()
    while True:
        await asyncio.sleep(1.0)
        heap.tick()
        await sharing.sync_round()


#: the targets the figures are printed against (issue: 10,000 nodes within budget)
TARGETS = ("targets: registering 10,000 nodes < 30 s on PostgreSQL, heartbeat p99 < 200 ms, dropout <= 30 s, "
           "longest event-loop block while they heartbeat < 50 ms")


async def run(size: int, backend: str) -> dict:
    """One sitting of ``size`` nodes on ``backend``: registration time, cadence, rates and
    heartbeat latencies (seconds)."""
    rng = random.Random(size)
    with database(backend) as db:
        app = build_app(TrackerSettings(db_path=db), run_loop=False, transport=httpx.MockTransport(healthy_nodes))
        async with LifespanManager(app):
            sharing = Sharing(app.state.service)
            await sharing.sync_round()  # it leads from the start, as a tracker whose loop runs before nodes come
            syncing = asyncio.create_task(sync_every_second(sharing))  # during the registrations too
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tracker",
                                         timeout=120.0) as client:
                t0 = time.perf_counter()
                signers, interval_s = await register_all(client, size)
                register_s = time.perf_counter() - t0
                lag = LoopLag()
                latencies, window_s, announced = await heartbeat_window(client, signers, interval_s, rng, lag)
                svc = app.state.service
                timeout_s = svc.cadence().timeout_s
                # a silent node is probed at the dropout deadline and dropped a round after its probe fails
                dropout_s = min(timeout_s, svc.dropout_deadline_s() + svc.settings.probe_timeout_s + 1.0)
            syncing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await syncing
            app.state.service.store.close()
    latencies.sort()
    sent = len(latencies)
    served_s = max(window_s, latencies[-1] if latencies else 0.0)
    return {"register_s": register_s, "interval_s": interval_s, "timeout_s": timeout_s, "dropout_s": dropout_s,
            "offered": size / interval_s, "sent": sent, "served": sent / served_s,
            "p50_ms": percentile(latencies, 0.5) * 1000, "p99_ms": percentile(latencies, 0.99) * 1000,
            "max_ms": latencies[-1] * 1000, "block_ms": lag.worst_s * 1000, "announced": announced}


def main() -> None:
    sizes = tuple(int(a) for a in sys.argv[1:] if a.isdigit()) or SIZES
    backends = tuple(a for a in sys.argv[1:] if a in BACKENDS) or BACKENDS
    runs = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--runs=")), "3"))
    log_as_served()
    print(f"python {platform.python_version()} on {platform.machine()}; window {WINDOW_S:.0f} s real time; "
          f"client and tracker share one event loop; median of {runs} sittings\n{TARGETS}")
    print(f"{'backend':>11} {'nodes':>7} {'reg s':>8} {'interval':>9} {'timeout':>9} {'dropout':>8} {'offer/s':>8} "
          f"{'sent':>6} {'served/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'block ms':>8}  load avg")
    for backend in backends:
        for size in sizes:
            results = [asyncio.run(run(size, backend)) for _ in range(runs)]
            r = {k: statistics.median(x[k] for x in results) for k in results[0] if k != "announced"}
            each_reg = " ".join(f"{x['register_s']:.1f}" for x in results)
            each_p99 = " ".join(f"{x['p99_ms']:.0f}" for x in results)
            print(f"{backend:>11} {size:>7,} {r['register_s']:>8.1f} {r['interval_s']:>9.1f} {r['timeout_s']:>9.1f} "
                  f"{r['dropout_s']:>8.1f} {r['offered']:>8.0f} {r['sent']:>6,.0f} {r['served']:>8.0f} "
                  f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} {r['block_ms']:>8.1f}  "
                  f"{os.getloadavg()[0]:.2f}"
                  f"  (reg s per sitting: {each_reg}; p99 ms: {each_p99})")


if __name__ == "__main__":
    main()
