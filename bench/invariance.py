"""Batch invariance on a real mesh (ADR-0064): what ``MESHNET_BATCH_INVARIANT=auto`` costs a 3-hop mesh.

Starts two meshes of three real node processes each (layers 0-9, 10-19, 20-29) in one recipe and
compute dtype, one at ``--mode`` (default ``auto``) and one at ``off``, with the nodes' default
speculation; both stay up, and greedy 64-token chats alternate between them. Prints each mesh's
decode tokens/s (timed from the client, :func:`bench.pipeline.timed_stream`), the medians of
``--runs``, their ratio and the load average. Under ``auto`` an int4 or int8 shard computing in
float32 runs its speculative spans position by position; this is their cost.

Run: ``.venv/bin/python bench/invariance.py [--recipe int4] [--dtype float32] [--runs 5]`` (about 3
minutes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pipeline import MODEL, timed_stream  # noqa: E402
from meshnet.localmesh import LocalMesh  # noqa: E402

STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
SPLIT = {"head": (0, 9), "middle": (10, 19), "tail": (20, 29)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="int4", help="the nodes' --quantization (default int4)")
    parser.add_argument("--dtype", default="float32", help="the nodes' --dtype (default float32)")
    parser.add_argument("--mode", default="auto", choices=("auto", "on"), help="the mode compared with off")
    parser.add_argument("--runs", type=int, default=5, help="chats per mesh (>= 3)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per chat")
    args = parser.parse_args()
    meshes: dict[str, LocalMesh] = {}
    try:
        for mode in (args.mode, "off"):
            mesh = LocalMesh(Path(tempfile.mkdtemp(prefix=f"meshnet-invariance-{mode}-")), heartbeat_s=1.0,
                             env={"MESHNET_BATCH_INVARIANT": mode})
            meshes[mode] = mesh
            mesh.start_tracker(MODEL, node_timeout_s=5.0)
            for name, (start, end) in SPLIT.items():
                # no spot-checks: a drawn session goes hop by hop over HTTP (ADR-0042), another path
                mesh.start_node(name, "--model", MODEL, "--shard-start", str(start), "--shard-end", str(end),
                                "--quantization", args.recipe, "--dtype", args.dtype, "--spot-check-rate", "0",
                                threads=1)
        for mesh in meshes.values():
            mesh.wait_routable(MODEL, 300)
            timed_stream(mesh.url, STORY, 4)  # warm-up
        runs: dict[str, list[float]] = {mode: [] for mode in meshes}
        for _ in range(args.runs):
            for mode, mesh in meshes.items():
                runs[mode].append(timed_stream(mesh.url, STORY, args.tokens)["decode_tokens_per_s"])
    finally:
        for mesh in meshes.values():
            mesh.stop()
    print(f"{args.recipe} in {args.dtype}, 3-hop mesh, default speculation, decode tokens/s, median of {args.runs}:")
    for mode, values in runs.items():
        print(f"  {mode:>4}: {statistics.median(values):6.1f}  ({', '.join(f'{v:.1f}' for v in values)})")
    ratio = statistics.median(runs[args.mode]) / statistics.median(runs["off"])
    print(f"  {args.mode}/off: {ratio:.3f}   load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
