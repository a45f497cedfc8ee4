"""Spot-check benchmark (ADR-0042): honest and dishonest distances, and the cost on decode.

Part 1, distances (in-process, real SmolLM2, bfloat16): layers 0-9 turn real prompts into
hidden states (and the tracker's challenges are random ones); layers 10-29 run each input
as two honest holders would: with 1 and with 2 torch threads, and in float32 and in bfloat16
compute (holders may differ in either), and the two bfloat16 frames are compared with the very measure the entry
uses (:func:`meshnet.dataplane.evidence.frame_distance`). The same inputs through copies with
noise on layer 15's MLP down-projection (the test-only corruption, scale x weight std) give the
dishonest distances. Prints min/median/max per kind and the margin to the tolerance.

Part 2, honest requests and overhead (real processes): an entry 0-9 with spot-checks at
``--rate`` and one without, three honest holders of 10-29; ``--requests`` greedy chats through
each entry; prints decode tokens/s and request seconds with and without checks, their ratio,
and whether any node was quarantined (none should be).

Part 3, the trust issue's acceptance figures, from the audit bench (:mod:`bench.audits`, ADR-0067; one
piece serves both): ``--audit-requests`` chats through an auditing entry and one without (honest holders on
different weight layouts and thread counts: false positives and the decode overhead at the default
settings), then the sensitivity curve: per ``--scales`` noise scale on a decode-lying holder,
requests routed through it until it is quarantined over ``--cycles`` quarantine-and-reinstate
cycles (``--withhold``: a liar that also keeps no transcript).

Usage: .venv/bin/python bench/spotcheck.py [--probes 200] [--requests 200] [--rate 0.02] [--max-tokens 16]
[--audit-requests 60] [--scales 0.5,0.2,0.1,0.05] [--cycles 20] [--withhold] [--skip-audits]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m-instruct"
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Explain photosynthesis briefly.",
           "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' to Spanish.",
           "What is 12 times 7?", "Name a large ocean.", "Describe a cat in one sentence.", "Say hi."]
BF16 = ("--dtype", "bfloat16", "--wire-dtype", "bfloat16")


def summary(values: list[float]) -> str:
    return (f"n={len(values)} min {min(values):.5f} median {statistics.median(values):.5f} "
            f"max {max(values):.5f}")


def distances(probes: int) -> None:
    import torch

    from meshnet.node import wire
    from meshnet.layers import LayerRange
    from meshnet.models.caches import KVCache
    from meshnet.models.shard import ShardModel
    from meshnet.models.sources import resolve
    from tests.corrupt import Corruption
    from meshnet.dataplane.evidence import challenge_frame, frame_distance, tolerance

    path = resolve(MODEL)
    entry = ShardModel(path, LayerRange(0, 10), dtype="bfloat16")
    honest = ShardModel(path, LayerRange(10, 30), dtype="bfloat16", load_head=False)
    inputs = []
    for i in range(probes):
        if i % 2 == 0:  # a real prompt's hidden states after layers 0-9
            text = PROMPTS[(i // 2) % len(PROMPTS)] + " " * (i // (2 * len(PROMPTS)))
            ids = entry.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
            ids = torch.tensor([list(ids)])
            with torch.inference_mode():
                hidden = entry.forward(entry.embed_tokens(ids, 0), KVCache(), 0)
            inputs.append(hidden)
        else:  # an admission challenge: random hidden states
            inputs.append(wire.decode(challenge_frame(i, 16, honest.config.hidden_size)))

    def run(shard, hidden, threads):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            return wire.encode(shard.forward(hidden, KVCache(), 0), dtype="bfloat16")

    honest_d = [frame_distance(run(honest, h, 1), run(honest, h, 2)) for h in inputs]
    print(f"honest (1 vs 2 threads, bfloat16 wire): {summary(honest_d)}")
    exact = ShardModel(path, LayerRange(10, 30), dtype="float32", load_head=False)
    mixed_d = [frame_distance(run(exact, h, 1), run(honest, h, 1)) for h in inputs]
    print(f"honest (a float32-compute holder vs a bfloat16 one, bfloat16 wire): {summary(mixed_d)}")
    # mixed recipes are never compared (witnesses and references share the checked shard's recipe)
    limit = tolerance("bfloat16")
    for scale in (0.05, 0.1, 0.5):
        bad = ShardModel(path, LayerRange(10, 30), dtype="bfloat16", load_head=False)

        class Runtime:  # what Corruption needs of a node runtime
            slots = {"bad": type("Slot", (), {"shard": bad, "key": f"bad x{scale}"})()}
            lock = __import__("threading").Lock()

        Corruption(layer=15, scale=scale).on_hop_call(Runtime)
        bad_d = [frame_distance(run(bad, h, 1), run(honest, h, 1)) for h in inputs[:max(20, probes // 5)]]
        caught = sum(d > limit for d in bad_d)
        print(f"dishonest (noise {scale} x std on layer 15): {summary(bad_d)}; above the tolerance {limit}: "
              f"{caught}/{len(bad_d)}")
    print(f"tolerance {limit}: the largest same-recipe honest distance is {max(honest_d):.5f} "
          f"(margin {limit - max(honest_d):.5f})")


def mesh_run(requests: int, rate: float, max_tokens: int) -> None:
    from meshnet.localmesh import LocalMesh

    with tempfile.TemporaryDirectory() as tmp:
        mesh = LocalMesh(Path(tmp), heartbeat_s=1.0)
        try:
            mesh.start_tracker(MODEL, node_timeout_s=10.0)
            for name, rate_of in (("entry-on", rate), ("entry-off", 0.0)):
                mesh.start_node(name, "--model", MODEL, "--shard-start", "0", "--shard-end", "9", *BF16,
                                env={"MESHNET_SPOT_CHECK_RATE": str(rate_of)})
            for name in ("h1", "h2", "h3"):
                mesh.start_node(name, "--model", MODEL, "--shard-start", "10", "--shard-end", "29", *BF16)
            mesh.wait(lambda: all(s["node_count"] >= 2 for s in mesh.get(f"/v1/coverage/{MODEL}")["segments"])
                      and len([n for n in mesh.get("/v1/nodes")["nodes"] if all(s["admitted"] for s in n["shards"])
                               and n["shards"]]) == 5, 300, "two entries and three admitted holders")
            entries = {n["node_id"]: n["endpoint"] for n in mesh.get("/v1/nodes")["nodes"]}
            results = {"entry-on": ([], []), "entry-off": ([], [])}
            for i in range(requests):
                for name in ("entry-on", "entry-off") if i % 2 == 0 else ("entry-off", "entry-on"):
                    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
                    t0 = time.perf_counter()
                    resp = httpx.post(f"{entries[name]}/v1/chat/completions", json=body, timeout=300)
                    resp.raise_for_status()
                    results[name][0].append(time.perf_counter() - t0)
                    results[name][1].append(resp.json()["meshnet"]["decode_tokens_per_s"])
            on_s, on_tps = results["entry-on"]
            off_s, off_tps = results["entry-off"]
            stats = httpx.get(f"{entries['entry-on']}/v1/health", timeout=5).json()["spot_checks"]
            quarantined = [n["node_id"] for n in mesh.get("/v1/nodes")["nodes"] if n.get("quarantine")]
            print(f"{requests} requests per entry, {max_tokens} tokens each, spot-check rate {rate}")
            print(f"  checks run {stats['checks']}, witness distances {sorted(set(stats['distances']))}, "
                  f"disputes {stats['disputes']}, quarantined nodes {quarantined or 'none'}")
            print(f"  decode tokens/s median: with checks {statistics.median(on_tps):.2f}, without "
                  f"{statistics.median(off_tps):.2f}, ratio {statistics.median(on_tps) / statistics.median(off_tps):.3f}")
            print(f"  request seconds mean: with checks {statistics.mean(on_s):.3f}, without {statistics.mean(off_s):.3f}, "
                  f"ratio {statistics.mean(on_s) / statistics.mean(off_s):.3f}")
        finally:
            mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0.02)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--skip-distances", action="store_true")
    parser.add_argument("--skip-mesh", action="store_true")
    parser.add_argument("--audit-requests", type=int, default=60, help="part 3: chats per entry (0 skips the cost)")
    parser.add_argument("--scales", default="0.5,0.2,0.1,0.05", help="part 3: noise scales (x the weight's std)")
    parser.add_argument("--cycles", type=int, default=20, help="part 3: quarantine-and-reinstate cycles per scale")
    parser.add_argument("--withhold", action="store_true", help="part 3: the liar keeps no transcript either")
    parser.add_argument("--skip-audits", action="store_true")
    args = parser.parse_args()
    if not args.skip_distances:
        distances(args.probes)
    if not args.skip_mesh:
        mesh_run(args.requests, args.rate, args.max_tokens)
    if not args.skip_audits:
        from bench.audits import cost, sensitivity

        if args.audit_requests:
            cost(args.audit_requests, 12)
        for scale in (float(x) for x in args.scales.split(",") if x):
            sensitivity(scale, args.cycles, 12, "weights", withhold=args.withhold)


if __name__ == "__main__":
    main()
