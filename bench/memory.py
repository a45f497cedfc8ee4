"""Resident memory of a node's shard above the bare runtime (issue 11, ADR-0039).

Each measurement runs in a fresh Python process (so nothing is shared or cached between
them) and prints one JSON line:

* ``bare``: imports torch, transformers, :mod:`meshnet.models.shard` and
  :mod:`meshnet.node.runtime`, runs a tiny
  matmul so torch's thread pool exists;
* ``runtime``: the same plus what any shard needs before its weights, in the given compute
  dtype (:func:`warm_runtime`: transformers' modeling code imported, a tiny model run once;
  :func:`prepare_layouts`: the weight layouts of the shard's shapes measured);
* ``shard``: ``bare``, then loads a :class:`ShardModel` of SmolLM2 layers 10-19 in the
  given compute dtype as a node does (:func:`meshnet.node.slots.measure_load`: modeling
  code imported and layouts measured first, a warm-up forward, the shard's own measured
  ``resident_bytes``, the figure doctor reports) and runs one more 16-token forward.

For each it records RSS (psutil) and ``/proc/self/smaps_rollup`` (Rss, Anonymous,
file-backed = Rss - Anonymous). The report is the median over ``--runs`` processes of RSS
above the bare median and above the runtime median, with the shard's weight bytes and the
ratios (the target of ADR-0039: at most 1.25x the weights above the runtime).

Run: ``PYTHONPATH=. .venv/bin/python bench/memory.py [--runs 3] [--layers 10-19]``.
Needs the converted SmolLM2 cache (``meshnet models pull`` or any node start).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024**2

CHILD = r"""
import json, sys
import psutil, torch, transformers
from meshnet.layers import LayerRange
from meshnet.models import shard as shard_mod
from meshnet.models.caches import KVCache
from meshnet.node.slots import measure_load

def smaps():
    out = {}
    try:
        for line in open("/proc/self/smaps_rollup"):
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out

torch.ones(64, 64) @ torch.ones(64, 64)
mode, dtype, start, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
weights = resident = 0
from meshnet.models.sources import model_dir
path = model_dir("smollm2-135m-instruct")
if mode == "runtime":
    shard_mod.warm_runtime(dtype)
    shard_mod.prepare_layouts(path, LayerRange(start, end), dtype=dtype)
if mode == "shard":
    model, resident = measure_load(lambda: shard_mod.ShardModel(path, LayerRange(start, end), dtype=dtype), dtype,
                                   lambda: shard_mod.prepare_layouts(path, LayerRange(start, end), dtype=dtype))
    weights = model.weight_bytes()
    hidden = torch.randn(1, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    model.forward(hidden, KVCache(), 0)
s = smaps()
print(json.dumps({"rss": psutil.Process().memory_info().rss, "anon": s.get("Anonymous", 0),
                  "file": s.get("Rss", 0) - s.get("Anonymous", 0), "weights": weights,
                  "resident": resident}))
"""


def measure(mode: str, dtype: str, layers: tuple[int, int]) -> dict:
    """One fresh process's figures (bytes): rss, anon, file, weights."""
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, dtype, str(layers[0]), str(layers[1])],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                                        **_env()}, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env() -> dict:
    import os
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def median_of(runs: list[dict], key: str) -> float:
    """Median of ``key`` over ``runs``."""
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", default="10-19", help="inclusive range, e.g. 10-19")
    args = parser.parse_args()
    first, last = (int(x) for x in args.layers.split("-"))
    layers = (first, last + 1)
    bare = [measure("bare", "float32", layers) for _ in range(args.runs)]
    base = {k: median_of(bare, k) for k in ("rss", "anon", "file")}
    print(f"bare: rss {base['rss'] / MIB:.0f} MiB (anon {base['anon'] / MIB:.0f}, "
          f"file {base['file'] / MIB:.0f}); medians of {args.runs} processes")
    for dtype in ("bfloat16", "float32"):
        runtime = [measure("runtime", dtype, layers) for _ in range(args.runs)]
        modeling = {k: median_of(runtime, k) for k in ("rss", "anon", "file")}
        print(f"{dtype:>8} runtime (modeling code, kernels run once): rss {modeling['rss'] / MIB:.0f} MiB "
              f"(+{(modeling['rss'] - base['rss']) / MIB:.0f} above bare)")
        runs = [measure("shard", dtype, layers) for _ in range(args.runs)]
        above = {k: median_of(runs, k) - base[k] for k in ("rss", "anon", "file")}
        own = median_of(runs, "rss") - modeling["rss"]
        weights = median_of(runs, "weights")
        print(f"{dtype:>8} layers {args.layers}: weights {weights / MIB:.1f} MiB; above bare "
              f"+{above['rss'] / MIB:.1f} MiB (anon +{above['anon'] / MIB:.1f}, file +{above['file'] / MIB:.1f}), "
              f"ratio {above['rss'] / weights:.2f}; above runtime +{own / MIB:.1f} MiB, ratio {own / weights:.2f}; "
              f"measured by the node (doctor) {median_of(runs, 'resident') / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
