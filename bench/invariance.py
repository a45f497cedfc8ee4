"""Batch invariance on a real mesh (ADR-0064): what ``MESHNET_BATCH_INVARIANT=auto`` costs a 3-hop mesh.

Starts two meshes of three real node processes each (layers 0-9, 10-19, 20-29) in one recipe and
compute dtype, one at ``--mode`` (default ``auto``) and one at ``off``, with the nodes' default
speculation; both stay up, and greedy 64-token chats alternate between them. Prints each mesh's
decode tokens/s (timed from the client, :func:`bench.pipeline.timed_stream`), the medians of
``--runs``, their ratio and the load average. Under ``auto`` an int4 or int8 shard computing in
float32 runs its speculative spans position by position; this is their cost.

Run: ``.venv/bin/python bench/invariance.py [--recipe int4] [--dtype float32] [--runs 5]`` (about 3
minutes).

``--sessions-apart`` measures instead, in-process, what keeping several sessions' rows off the float32
path costs a host that has one (ADR-0047; ADR-0064 amended 2026-12-08): one 30-layer bfloat16 shard,
a decode step of 4, 8 and 16 sessions and one session's speculative span of 8 positions, each timed
as ``auto`` runs it now (the sessions apart, spans of up to 17 positions on the half kernel) and as it
ran before (products from ``min_rows`` rows in float32 whoever's rows they are), interleaved, medians of
``--runs``. Emulate a CPU without native bfloat16 with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` and fix its
crossover with ``MESHNET_UPCAST_MIN_ROWS=4`` (what such a host's timing chose in a CI run).
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
    parser.add_argument("--sessions-apart", action="store_true",
                        help="in-process: the cost of keeping several sessions' rows off the float32 path")
    args = parser.parse_args()
    if args.sessions_apart:
        sessions_apart(max(args.runs, 3) * 4)
        return
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


def sessions_apart(runs: int) -> None:
    """Print the ``--sessions-apart`` figures (see the module doc); ``runs`` samples of each."""
    import time

    import torch

    from meshnet.layers import LayerRange
    from meshnet.models.caches import KVCache
    from meshnet.models.kernels import PackedLinear, UpcastLinear
    from meshnet.models.shard import ShardModel
    from meshnet.models.sources import resolve

    torch.set_num_threads(1)  # as the mesh's nodes run
    shard = ShardModel(resolve(MODEL), LayerRange(0, 30), dtype="bfloat16", load_head=False)
    layers = [m for m in shard.blocks.modules() if isinstance(m, (UpcastLinear, PackedLinear))]
    now = [(m, m.min_rows, m.apart) for m in layers]
    crossover = int(os.environ.get("MESHNET_UPCAST_MIN_ROWS", "0") or 0)
    if not any(apart for _, _, apart in now) or not crossover:
        print("no float32 path here (or MESHNET_UPCAST_MIN_ROWS not set): nothing to compare")
        return
    before = [(m, crossover, False) for m in layers]
    gen = torch.Generator().manual_seed(0)
    caches = []
    for length in (7, 12, 20, 31, 9, 15, 26, 40, 11, 18, 24, 33, 8, 14, 21, 36):
        cache = KVCache()
        shard.forward(torch.randn(1, length, 576, generator=gen).to(torch.bfloat16), cache, 0)
        caches.append(cache)

    def timed(setting, step) -> float:
        for m, rows, apart in setting:
            m.min_rows, m.apart = rows, apart
        run, undo = step
        t0 = time.perf_counter()
        run()
        elapsed = (time.perf_counter() - t0) * 1000
        undo()  # the caches back to their length, untimed
        return elapsed

    def decode(sessions: int):
        hidden = torch.randn(sessions, 1, 576, generator=gen).to(torch.bfloat16)
        lengths = [c.get_seq_length() for c in caches[:sessions]]
        return (lambda: shard.forward_batch(hidden, caches[:sessions], lengths),
                lambda: [c.rewind(1) for c in caches[:sessions]])

    def span(tokens: int):
        hidden = torch.randn(1, tokens, 576, generator=gen).to(torch.bfloat16)
        return (lambda: shard.forward(hidden, caches[0], caches[0].get_seq_length()),
                lambda: caches[0].rewind(tokens))

    print(f"{MODEL}, 30 bfloat16 layers, 1 thread, float32 path from {crossover} rows; ms per step, median of {runs}:")
    for label, step in [(f"decode step of {n} sessions", decode(n)) for n in (4, 8, 16)] + \
                       [("one session's span of 8 positions", span(8))]:
        samples: dict[str, list[float]] = {"now": [], "before": []}
        for k in range(runs):
            for name in (("now", "before") if k % 2 == 0 else ("before", "now")):
                samples[name].append(timed(now if name == "now" else before, step))
        a, b = statistics.median(samples["now"]), statistics.median(samples["before"])
        print(f"  {label:<36} now {a:7.1f}   before {b:7.1f}   now/before {a / b:.2f}")
    for m, rows, apart in now:
        m.min_rows, m.apart = rows, apart
    print(f"  load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
