"""What an admission reference from the model's own files costs the tracker (ADR-0070).

For each recipe and layer range, in a fresh child process each (so peak memory is the work's own):
the seconds :meth:`meshnet.node.reference.SourceReferences.compute` takes on a 16-token challenge
(the median of ``--runs`` after one warm-up, which pays the process's one-off host timings), and
the child's peak resident memory, beside the same figures for loading the whole range as one
:class:`meshnet.models.shard.ShardModel` and running it (what a holder does). Also prints the
reference's distance to that whole-range output (0.0 expected on one host). Load average printed.

Run: ``.venv/bin/python bench/references.py [--runs 3]`` (about 2 minutes; needs ``make model``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m-instruct"
CASES = [("bfloat16", "bfloat16", 10, 20), ("bfloat16", "bfloat16", 0, 30), ("int8", "bfloat16", 10, 20),
         ("int4", "float32", 10, 20)]

CHILD = r"""
import json, resource, statistics, sys, time
import torch
from meshnet.dataplane.evidence import challenge_frame, frame_distance
from meshnet.layers import LayerRange
from meshnet.models.caches import KVCache
from meshnet.models.shard import ShardModel
from meshnet.models.sources import held_locally
from meshnet.node import wire
from meshnet.node.reference import SourceReferences
how, quantization, dtype, start, end, runs = sys.argv[1:7]
layers, runs = LayerRange(int(start), int(end)), int(runs)
frame = challenge_frame(5, 16, 576)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if how == "reference":
    ref = SourceReferences(("%s",))
    run = lambda: ref.compute("%s", layers, quantization, dtype, frame)
else:
    def run():
        shard = ShardModel(held_locally("%s"), layers, dtype=dtype, load_head=False, quantization=quantization)
        return wire.encode(shard.forward(wire.decode(frame), KVCache(), 0), dtype=torch.float32)
out = run()
times = []
for _ in range(runs):
    t0 = time.perf_counter()
    out = run()
    times.append(time.perf_counter() - t0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"s": statistics.median(times), "peak_mib": peak / 1024, "growth_mib": (peak - base) / 1024,
                  "frame": out.hex()}))
""" % (MODEL, MODEL, MODEL)


def child(how: str, quantization: str, dtype: str, start: int, end: int, runs: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, how, quantization, dtype, str(start), str(end), str(runs)],
                          capture_output=True, text=True, cwd=ROOT, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from meshnet.dataplane.evidence import frame_distance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per case after a warm-up (>= 3)")
    args = parser.parse_args()
    print(f"{'recipe':<18} {'layers':<7} {'reference s':>11} {'whole s':>8} {'ratio':>6} "
          f"{'ref growth MiB':>14} {'whole growth MiB':>16} {'distance':>9}")
    for quantization, dtype, start, end in CASES:
        ref = child("reference", quantization, dtype, start, end, args.runs)
        whole = child("whole", quantization, dtype, start, end, args.runs)
        distance = frame_distance(bytes.fromhex(ref["frame"]), bytes.fromhex(whole["frame"]))
        print(f"{quantization + '/' + dtype:<18} {f'{start}-{end - 1}':<7} {ref['s']:>11.2f} {whole['s']:>8.2f} "
              f"{ref['s'] / whole['s']:>6.2f} {ref['growth_mib']:>14.0f} {whole['growth_mib']:>16.0f} "
              f"{distance:>9.4f}")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
