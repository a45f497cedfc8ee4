"""Benchmark of the tracker's placement planner (meshnet.tracker.placement, ADR-0003).

Builds seeded random networks of 100, 1,000 and 10,000 nodes over 20 models and times
one full ``plan_placement`` (median of 5 runs, ``time.perf_counter``) in two states:

* ``join``: 30 % of nodes already hold shards (pinned, bootstrap or managed), the rest
  just joined idle - gap filling, managed moves and redundancy all run;
* ``steady``: re-planning the state the first plan produced (must yield nothing).

Run: ``.venv/bin/python bench/placement.py``. Target: under 100 ms at 10,000 nodes.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshnet.layers import LayerRange  # noqa: E402
from meshnet.tracker.placement import (  # noqa: E402
    Assignment, ModelSpec, NodeState, apply_plan, max_assignable_layers, plan_placement)

GIB = 1024**3
SIZES = (100, 1_000, 10_000)
RUNS = 5
TARGET_MS = 100.0
HIDDEN_SIZES = (576, 960, 2048, 3072, 4096, 5120, 8192)   # SmolLM2-135M ... Llama-70B widths
QUANTIZATIONS = ("bfloat16", "int8", "nf4")


def make_models(rng: random.Random, count: int = 20) -> list[ModelSpec]:
    """``count`` models, 24-80 layers; a layer holds ~12·hidden² parameters (2 bytes in
    bfloat16, ~1 in int8, ~0.5 in nf4, plus per-block scales)."""
    models = []
    for k in range(count):
        hidden = rng.choice(HIDDEN_SIZES)
        params = 12 * hidden * hidden
        models.append(ModelSpec(name=f"model-{k:02d}", num_layers=rng.randint(24, 80),
                                bytes_per_layer={"bfloat16": 2 * params, "int8": params + params // 64,
                                                 "nf4": params // 2 + params // 32},
                                demand=round(rng.choice((0.0, 0.0, rng.uniform(0, 50))), 2)))
    return models


def make_nodes(rng: random.Random, count: int, models: list[ModelSpec]) -> list[NodeState]:
    """``count`` nodes: 2-80 GiB, lognormal speed, 1-4 slots; 30 % already hold a shard."""
    nodes = []
    for k in range(count):
        vram = rng.randint(2 * GIB, 80 * GIB)
        quant = rng.choices(QUANTIZATIONS, weights=(5, 3, 2))[0]
        node = NodeState(node_id=f"node-{k:05d}", vram_bytes=vram, quantization=quant,
                         tokens_per_s=round(rng.lognormvariate(3.0, 0.8), 2),
                         max_loaded_shards=rng.randint(1, 4))
        if rng.random() < 0.3:
            model = rng.choice(models)
            fit = min(model.num_layers, max_assignable_layers(vram, model.bytes_per_layer[quant]))
            if fit >= 1:
                start = rng.randint(0, model.num_layers - fit)
                tier = rng.choices(("pinned", "bootstrap", "managed"), weights=(1, 6, 3))[0]
                node = NodeState(**{**node.__dict__, "assignments": (
                    Assignment(model.name, LayerRange(start, start + fit), tier),)})
        nodes.append(node)
    return nodes


def time_ms(nodes: list[NodeState], models: list[ModelSpec]) -> float:
    """Median wall time of ``RUNS`` full plans, in milliseconds."""
    samples = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        plan_placement(nodes, models)
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def main() -> None:
    print(f"{'nodes':>7} {'models':>6} {'join ms':>9} {'loads':>6} {'drops':>6} {'steady ms':>10} {'replan':>7}")
    join_at_max = 0.0
    for size in SIZES:
        rng = random.Random(size)
        models = make_models(rng)
        nodes = make_nodes(rng, size, models)
        join = time_ms(nodes, models)
        plan = plan_placement(nodes, models)
        settled = apply_plan(nodes, plan)
        again = plan_placement(settled, models)
        steady = time_ms(settled, models)
        changes = "none" if not (again.loads or again.drops) else f"{len(again.loads) + len(again.drops)}!"
        print(f"{size:>7} {len(models):>6} {join:>9.1f} {len(plan.loads):>6} {len(plan.drops):>6} "
              f"{steady:>10.1f} {changes:>7}")
        join_at_max = max(join, steady) if size == SIZES[-1] else join_at_max
    print(f"\n10,000 nodes: {join_at_max:.1f} ms = {join_at_max / TARGET_MS:.2f}x the {TARGET_MS:.0f} ms target "
          f"({'OK' if join_at_max < TARGET_MS else 'OVER'})")


if __name__ == "__main__":
    main()
