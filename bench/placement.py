"""Benchmark of the tracker's placement planner (meshnet.tracker.placement, ADR-0003).

Builds seeded random networks of 100, 1,000 and 10,000 nodes over 20 models and times
one full ``plan_placement`` (median of 5 runs, ``time.perf_counter``) in three states:

* ``cold``: 30 % of nodes hold a shard (pinned, bootstrap or managed) and 70 % have
  just joined idle - the worst case: thousands of gap, redundancy and move decisions;
* ``churn``: the settled network after 5 % of nodes left and 5 % new idle nodes joined,
  what the 30 s rebalance loop sees in a busy network;
* ``steady``: re-planning the settled network, which must yield no loads and no drops.

Then, at 10,000 nodes over 20 models (the ``cold`` network), one full tracker rebalance as the
tracker's control loop runs it (:func:`meshnet.tracker.rebalance.rebalance_off_loop`): placement
inputs on the event loop, the plan and the write of every directive in one transaction on worker
threads, on each backend: a sqlite file in a temporary directory, and a fresh PostgreSQL database
(ADR-0043; the server of ``MESHNET_BENCH_PG``, default ``postgresql://postgres@127.0.0.1:5432/test``;
``MESHNET_BENCH_PG=off`` leaves it out). It prints the wall time, the planner's and the write's
shares, and the longest event-loop block meanwhile, seen by a probe task that sleeps 1 ms in a
loop and records how late it wakes (:mod:`bench.looplag`, ADR-0037).

Last, how long the leader's dropout check holds the event loop (and takes in all) when 100, 1,000
or 5,000 of the 10,000 nodes go silent at once, and how long a tracker that starts or takes over holds it while it
reads every shared record (target: under 50 ms, as any block).

Run: ``.venv/bin/python bench/placement.py`` (``--rebalance-only``: the last three parts). Target: under
100 ms at 10,000 nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.looplag import LoopLag, log_as_served  # noqa: E402
from meshnet.layers import LayerRange  # noqa: E402
from meshnet.tracker import placement  # noqa: E402
from meshnet.tracker.placement import (  # noqa: E402
    Assignment, ModelSpec, NodeState, apply_plan, max_assignable_layers, plan_placement)
from meshnet.tracker.rebalance import rebalance_off_loop  # noqa: E402
from meshnet.tracker.registry import NodeRecord, ShardRecord  # noqa: E402
from meshnet.tracker.service import ModelInfo, TrackerService, TrackerSettings  # noqa: E402

GIB = 1024**3
SIZES = (100, 1_000, 10_000)
RUNS = 5
TARGET_MS = 100.0
#: the longest event-loop block a rebalance may cause, ms (issue: < 50 ms at 10,000 nodes)
BLOCK_TARGET_MS = 50.0
HIDDEN_SIZES = (576, 960, 2048, 3072, 4096, 5120, 8192)   # SmolLM2-135M ... 70B-class widths
QUANTIZATIONS = ("bfloat16", "int8", "nf4")


def make_models(rng: random.Random, count: int = 20) -> list[ModelSpec]:
    """``count`` models of 24-80 layers; a layer holds ~12·hidden² parameters: 2 bytes each
    in bfloat16, ~1 in int8 and ~0.5 in nf4 (plus per-block scales)."""
    models = []
    for k in range(count):
        params = 12 * rng.choice(HIDDEN_SIZES) ** 2
        models.append(ModelSpec(name=f"model-{k:02d}", num_layers=rng.randint(24, 80),
                                bytes_per_layer={"bfloat16": 2 * params, "int8": params + params // 64,
                                                 "nf4": params // 2 + params // 32},
                                demand=round(rng.choice((0.0, 0.0, rng.uniform(0, 50))), 2)))
    return models


def make_node(rng: random.Random, node_id: str, models: list[ModelSpec], held: float) -> NodeState:
    """A node of 2-80 GiB, lognormal tokens/s, 1-4 slots; with probability ``held`` it
    already serves as many layers of one random model as fit."""
    vram = rng.randint(2 * GIB, 80 * GIB)
    quant = rng.choices(QUANTIZATIONS, weights=(5, 3, 2))[0]
    node = NodeState(node_id=node_id, vram_bytes=vram, quantization=quant,
                     tokens_per_s=round(rng.lognormvariate(3.0, 0.8), 2), max_loaded_shards=rng.randint(1, 4))
    spec = rng.choice(models)
    fit = min(spec.num_layers, max_assignable_layers(vram, spec.bytes_per_layer[quant]))
    if rng.random() >= held or fit < 1:
        return node
    start = rng.randint(0, spec.num_layers - fit)
    tier = rng.choices(("pinned", "bootstrap", "managed"), weights=(1, 6, 3))[0]
    return node._replace(assignments=(Assignment(spec.name, LayerRange(start, start + fit), tier),))


def cold_network(size: int) -> tuple[random.Random, list[ModelSpec], list[NodeState]]:
    """The seeded ``cold`` network of ``size`` nodes (30 % hold a shard, the rest idle) over 20 models,
    and its generator (the churn that follows draws from it)."""
    rng = random.Random(size)
    models = make_models(rng)
    return rng, models, [make_node(rng, f"node-{k:05d}", models, held=0.3) for k in range(size)]


def backends() -> tuple[str, ...]:
    """The backends the figures are printed for (``MESHNET_BENCH_PG=off``: sqlite alone)."""
    return ("sqlite",) if PG_SERVER == "off" else ("postgresql", "sqlite")


def churn(rng: random.Random, nodes: list[NodeState], models: list[ModelSpec], share: float) -> list[NodeState]:
    """``nodes`` less a random ``share`` of them, plus as many new idle nodes."""
    leaving = set(rng.sample(range(len(nodes)), int(len(nodes) * share)))
    joining = [make_node(rng, f"new-{k:05d}", models, held=0.0) for k in range(len(leaving))]
    return [n for k, n in enumerate(nodes) if k not in leaving] + joining


def median_ms(nodes: list[NodeState], models: list[ModelSpec]) -> float:
    """Median wall time of ``RUNS`` full plans, in milliseconds."""
    samples = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        plan_placement(nodes, models)
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def main() -> None:
    print(f"python {platform.python_version()} on {platform.machine()}; median of {RUNS} runs, ms")
    print(f"{'nodes':>7} {'cold ms':>9} {'loads':>6} {'churn ms':>9} {'loads':>6} {'steady ms':>10} {'replan':>7}")
    at_max = {}
    for size in SIZES:
        rng, models, cold = cold_network(size)
        cold_plan = plan_placement(cold, models)
        settled = apply_plan(cold, cold_plan)
        churned = churn(rng, settled, models, 0.05)
        churn_plan = plan_placement(churned, models)
        again = plan_placement(settled, models)
        replan = "none" if not (again.loads or again.drops) else f"{len(again.loads) + len(again.drops)}!"
        times = {"cold": median_ms(cold, models), "churn": median_ms(churned, models),
                 "steady": median_ms(settled, models)}
        print(f"{size:>7} {times['cold']:>9.1f} {len(cold_plan.loads):>6} {times['churn']:>9.1f} "
              f"{len(churn_plan.loads):>6} {times['steady']:>10.1f} {replan:>7}")
        at_max = times
    print(f"\nat {SIZES[-1]:,} nodes, against the {TARGET_MS:.0f} ms target:")
    for name, ms in at_max.items():
        print(f"  {name:<7} {ms:7.1f} ms = {ms / TARGET_MS:.2f}x  {'OK' if ms < TARGET_MS else 'OVER'}")


def tracker_with(nodes: list[NodeState], models: list[ModelSpec], db_path: str) -> TrackerService:
    """A tracker service whose registry holds ``nodes`` (reachable, their shards as reported) and
    tracks ``models``, with chat load matching each model's demand; its store is ``db_path``."""
    svc = TrackerService(TrackerSettings(db_path=db_path))
    now = time.monotonic()
    for m in models:
        svc.models[m.name] = ModelInfo(m.name, m.num_layers, dict(m.bytes_per_layer))
        svc.track_model(m.name)
        svc.served[m.name] = [now] * round(m.demand * svc.settings.demand_window_s / 60)
    for n in nodes:
        shards = [ShardRecord(a.model, a.layers, a.tier, n.quantization, a.layers.start == 0, 0, None)
                  for a in n.assignments]
        svc.nodes[n.node_id] = NodeRecord(n.node_id, f"http://{n.node_id}.test:8000", "", n.vram_bytes, 0, "cpu",
                                          [n.quantization], n.tokens_per_s, None, n.max_loaded_shards, True,
                                          shards=shards, reachable=True)
    return svc


async def timed_rebalance(svc: TrackerService) -> dict[str, float]:
    """One :func:`rebalance_off_loop` with a loop-lag probe beside it: wall, plan, write and longest
    block, ms."""
    written, planned = {"ms": 0.0, "rows": 0}, {"ms": 0.0}
    write, plan = svc.store.add_directives, placement.plan_placement

    def timed_write(new, **kw):
        t0 = time.perf_counter()
        ids = write(new, **kw)
        written["ms"], written["rows"] = (time.perf_counter() - t0) * 1000, len(ids)
        return ids

    def timed_plan(*args):
        t0 = time.perf_counter()
        out = plan(*args)
        planned["ms"] = (time.perf_counter() - t0) * 1000
        return out

    svc.store.add_directives = timed_write
    placement.plan_placement = timed_plan
    async with LoopLag() as lag:
        t0 = time.perf_counter()
        try:
            await rebalance_off_loop(svc)
        finally:
            placement.plan_placement = plan
        wall_ms = (time.perf_counter() - t0) * 1000
    return {"wall_ms": wall_ms, "plan_ms": planned["ms"], "write_ms": written["ms"], "rows": written["rows"],
            "block_ms": lag.worst_s * 1000}


#: the PostgreSQL server a scratch database is made on (``off``: sqlite only)
PG_SERVER = os.environ.get("MESHNET_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextlib.contextmanager
def database(backend: str):
    """A fresh ``--db`` of ``backend`` (``sqlite`` or ``postgresql``) for the block."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield f"{tmp}/tracker.db"
    else:
        from meshnet.tracker.pgstore import scratch_database
        with scratch_database(PG_SERVER, prefix="meshnet_bench") as url:
            yield url


def rebalance_figures(size: int = SIZES[-1], runs: int = 3) -> None:
    """Print the full rebalance at ``size`` nodes (the ``cold`` network of :func:`main`'s seed), per
    backend: the median of ``runs``, each on a fresh database, with the load average beside it."""
    log_as_served()
    _, models, cold = cold_network(size)
    print(f"\nfull rebalance at {size:,} nodes x {len(models)} models (rebalance_off_loop), ms, median of {runs} "
          f"(each on a fresh database); targets: wall with the write < {TARGET_MS:.0f}, block < {BLOCK_TARGET_MS:.0f}")
    print(f"{'backend':>11} {'wall':>6} {'plan':>6} {'write':>6} {'rows':>6} {'rest':>6} {'block':>6}  "
          f"{'runs (wall/block)':<30} load avg")
    for backend in backends():
        results = []
        for _ in range(runs):
            with database(backend) as db:
                svc = tracker_with(cold, models, db)
                gc.collect()  # the previous run's garbage is not this one's time
                results.append(asyncio.run(timed_rebalance(svc)))
                svc.store.close()
                del svc
        r = {k: statistics.median(x[k] for x in results) for k in results[0]}
        rest = r["wall_ms"] - r["write_ms"] - r["plan_ms"]
        each = " ".join(f"{x['wall_ms']:.0f}/{x['block_ms']:.0f}" for x in results)
        verdict = "OK" if r["wall_ms"] < TARGET_MS and r["block_ms"] < BLOCK_TARGET_MS else "OVER"
        print(f"{backend:>11} {r['wall_ms']:>6.0f} {r['plan_ms']:>6.0f} {r['write_ms']:>6.0f} {r['rows']:>6,.0f} "
              f"{rest:>6.0f} {r['block_ms']:>6.0f}  {each:<30} {os.getloadavg()[0]:.2f}  {verdict}")
    print("  (write: every directive in one transaction, on a worker thread; rest: inputs, demand moves, apply; "
          "block: the longest the event loop waited)")


#: nodes of the 10,000 that go silent at once in :func:`dropout_figures` (a rack, a region)
DROPOUTS = (100, 1_000, 5_000)


def dropout_figures(size: int = SIZES[-1], runs: int = 3) -> None:
    """Print how long the leader's dropout check holds the event loop when many of ``size`` nodes
    go silent at once (:meth:`TrackerService.check_dropouts_off_loop`, as the control loop runs it:
    the nodes forgotten on the loop, the store read and the failing of their open directives on
    worker threads), per backend, the median of ``runs``: the longest block, and the whole check."""
    from meshnet.tracker.sharing import Sharing

    _, models, cold = cold_network(size)
    print(f"\nnodes dropping out at once from {size:,} (check_dropouts_off_loop as the leader), longest event-loop "
          f"block / whole check, ms, median of {runs}; target: block < {BLOCK_TARGET_MS:.0f}")
    print(f"{'backend':>11} " + " ".join(f"{n:>11,}" for n in DROPOUTS) + "  load avg")
    for backend in backends():
        cells = []
        for gone in DROPOUTS:
            blocks, walls = [], []
            for _ in range(runs):
                with database(backend) as db:
                    svc = tracker_with(cold, models, db)
                    asyncio.run(Sharing(svc).sync_round())  # it leads, as the tracker whose loop drops them
                    now = time.monotonic()
                    for k, node in enumerate(svc.nodes.values()):
                        node.last_heartbeat_s = now - 3600.0 if k < gone else now
                    gc.collect()

                    async def check() -> tuple[float, float, list[str]]:
                        async with LoopLag() as lag:
                            t0 = time.perf_counter()
                            dropped = await svc.check_dropouts_off_loop(now)
                            wall = (time.perf_counter() - t0) * 1000
                        return lag.worst_s * 1000, wall, dropped

                    block, wall, dropped = asyncio.run(check())
                    blocks.append(block)
                    walls.append(wall)
                    assert len(dropped) == gone, (backend, gone, len(dropped))
                    svc.store.close()
            cells.append((statistics.median(blocks), statistics.median(walls)))
        verdict = "OK" if max(b for b, _ in cells) < BLOCK_TARGET_MS else "OVER"
        print(f"{backend:>11} " + " ".join(f"{b:>5.0f} /{w:>4.0f}" for b, w in cells) +
              f"  {os.getloadavg()[0]:.2f}  {verdict}")


def takeover_figures(size: int = SIZES[-1], runs: int = 3) -> None:
    """Print what a tracker that starts or takes over pays to read every shared node record of a
    ``size``-node network (PostgreSQL): its first sync round's wall time and the longest event-loop
    block meanwhile (:class:`meshnet.tracker.sharing.Sharing`), the median of ``runs``."""
    if PG_SERVER == "off":
        return
    from meshnet.tracker.sharing import Sharing

    _, models, cold = cold_network(size)
    walls, blocks = [], []
    for _ in range(runs):
        with database("postgresql") as db:
            reader = TrackerService(TrackerSettings(db_path=db))  # made first: the bench's models are no presets
            writer = tracker_with(cold, models, db)
            writer.store.save_nodes([writer.node_row(n) for n in writer.nodes.values()])
            reader.models.update(writer.models)
            writer.store.close()
            del writer  # another process's heap in a real network: not this tracker's to collect
            gc.collect()

            async def first_round() -> float:
                async with LoopLag() as lag:
                    t0 = time.perf_counter()
                    await Sharing(reader).sync_round()
                    walls.append((time.perf_counter() - t0) * 1000)
                return lag.worst_s * 1000

            blocks.append(asyncio.run(first_round()))
            assert len(reader.nodes) == size
            reader.store.close()
    verdict = "OK" if statistics.median(blocks) < BLOCK_TARGET_MS else "OVER"
    print(f"\na tracker reading all {size:,} shared records (its first sync round, PostgreSQL), median of {runs}: "
          f"wall {statistics.median(walls):.0f} ms, longest block {statistics.median(blocks):.0f} ms "
          f"(runs {' '.join(f'{w:.0f}/{b:.0f}' for w, b in zip(walls, blocks))}; target < {BLOCK_TARGET_MS:.0f})  "
          f"load avg {os.getloadavg()[0]:.2f}  {verdict}")


if __name__ == "__main__":
    if "--rebalance-only" not in sys.argv:
        main()
    rebalance_figures()
    dropout_figures()
    takeover_figures()
