"""Recipes benchmark (ADR-0061): what each recipe costs and gives on SmolLM2-135M, on this host.

Per recipe (default ``bfloat16,int8,int4``; ``float32`` and ``nf4`` on request), in one sitting:

* one process: the whole model (layers 0-29, embeddings and head) in this process, greedy
  decode tokens/s over ``--decode-tokens`` tokens (``(tokens - 1) / time``, a fresh KV cache each
  run) and prompt tokens/s of a ``--prompt-tokens`` prefill (logits of the last position only,
  as an entry computes);
* a 3-hop mesh: a tracker and three real node processes (layers 0-9, 10-19, 20-29) in the
  recipe, ``--threads`` torch threads each; decode tokens/s and prompt tokens/s timed from the
  client (:func:`bench.pipeline.timed_stream`: the first content chunk to the last, and the
  request to the first chunk of a one-token answer), speculation off unless ``--speculate`` says;
* the decoder-layer weight bytes of a 10-layer middle shard (every parameter and buffer of
  layers 10-19) and their ratio to bfloat16's (target for int4: <= 0.35);
* the cost of batch invariance (ADR-0064): one process's decode tokens/s of one session and of
  8 decoding together, batch-invariant (the default) and with ``MESHNET_BATCH_INVARIANT=off``;
* the distance to float32: relative L2 of the last position's output of layer 29 for the prompt
  against the float32 model (the doctor's measure, on real text instead of a random probe).

Medians of ``--runs`` runs (>= 3) with the load average printed. With ``--llama-bench PATH
--gguf PATH`` it also runs llama.cpp's ``llama-bench`` on that GGUF (``-p`` and ``-n`` as above,
``-t`` the one-process thread count) and prints its figures beside; without them that column is
skipped. Targets (issue "fast recipes"): the best recipe's 3-hop decode >= llama.cpp's RPC split
on this machine (36 tokens/s measured there) and one process >= 0.5x llama.cpp monolithic.

Run: ``.venv/bin/python bench/recipes.py [--recipes bfloat16,int8,int4] [--runs 3] [--threads 1]
[--no-mesh] [--llama-bench PATH --gguf PATH]`` (about 2 minutes a recipe with the mesh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.pipeline import MODEL, chat_ids, prompt_of, timed_stream  # noqa: E402
from meshnet.layers import LayerRange  # noqa: E402
from meshnet.localmesh import LocalMesh  # noqa: E402
from meshnet.models.caches import KVCache  # noqa: E402
from meshnet.node.runtime import NodeRuntime  # noqa: E402

STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
#: the 3-hop split every mesh run uses (inclusive layer ranges)
SPLIT = {"head": (0, 9), "middle": (10, 19), "tail": (20, 29)}
#: llama.cpp's RPC split over 3 processes, decode tokens/s, as the issue measured it on its (AVX2)
#: machine; on an AVX-512 host it measured 57.1 (ADR-0062): compare in one sitting where you can
RPC_SPLIT_TOKENS_PER_S = 36.0
INT4_BYTES_TARGET = 0.35


def compute_dtype(recipe: str) -> str:
    """float32 runs in float32; every other recipe computes in bfloat16 (the node's default)."""
    return "float32" if recipe == "float32" else "bfloat16"


def load(recipe: str, layers: LayerRange, model_path: Path):
    return NodeRuntime(compute_dtype=compute_dtype(recipe)).load(MODEL, model_path, layers, quantization=recipe).shard


@torch.inference_mode()
def decode_rate(shard, prompt: list[int], tokens: int) -> float:
    """Greedy decode tokens/s of the whole-model ``shard`` after a prefill of ``prompt``."""
    cache = KVCache()
    hidden = shard.forward(shard.embed_tokens(torch.tensor([prompt]), 0), cache, 0)
    token, position = int(shard.logits(hidden[:, -1:])[0, -1].argmax()), len(prompt)
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        hidden = shard.forward(shard.embed_tokens(torch.tensor([[token]]), position), cache, position)
        token, position = int(shard.logits(hidden)[0, -1].argmax()), position + 1
    return (tokens - 1) / (time.perf_counter() - t0)


@torch.inference_mode()
def prefill(shard, prompt: list[int]) -> tuple[float, torch.Tensor]:
    """(seconds, the last position's output of the shard's last layer as float32 ``[hidden]``) of one prefill."""
    t0 = time.perf_counter()
    hidden = shard.forward(shard.embed_tokens(torch.tensor([prompt]), 0), KVCache(), 0)
    shard.logits(hidden[:, -1:])
    elapsed = time.perf_counter() - t0
    return elapsed, hidden[0, -1].float()


def one_process(recipe: str, model_path: Path, prompt: list[int], story: list[int], args) -> dict:
    shard = load(recipe, LayerRange(0, 30), model_path)
    decode_rate(shard, story, 4)  # warm-up: first kernels, allocator
    decode = [decode_rate(shard, story, args.decode_tokens) for _ in range(args.runs)]
    prefills = [prefill(shard, prompt) for _ in range(args.runs)]
    middle = load(recipe, LayerRange(10, 20), model_path).weight_bytes()
    return {"decode": statistics.median(decode), "decode_runs": decode,
            "prompt": len(prompt) / statistics.median(p[0] for p in prefills),
            "final": prefills[0][1], "middle_bytes": middle}


@torch.inference_mode()
def batch_rate(shard, prompt: list[int], sessions: int, steps: int) -> float:
    """Greedy decode tokens/s of ``sessions`` sessions decoding together (one batched step each
    token, :meth:`ShardModel.forward_batch`), their prompts ``prompt`` cut to different lengths."""
    caches, tokens, positions = [], [], []
    for k in range(sessions):
        ids = prompt[:max(1, len(prompt) - 3 * k)]
        caches.append(KVCache())
        hidden = shard.forward(shard.embed_tokens(torch.tensor([ids]), 0), caches[-1], 0)
        tokens.append(int(shard.logits(hidden[:, -1:])[0, -1].argmax()))
        positions.append(len(ids))
    t0 = time.perf_counter()
    for _ in range(steps):
        hidden = shard.forward_batch(shard.embed_tokens(torch.tensor(tokens)[:, None], positions), caches, positions)
        tokens = shard.logits(hidden)[:, -1].argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    return sessions * steps / (time.perf_counter() - t0)


def invariance_cost(recipe: str, model_path: Path, story: list[int], args) -> dict:
    """Decode tokens/s of one session and of 8 together, batch-invariant (the default, ADR-0064)
    and not (``MESHNET_BATCH_INVARIANT=off``): both shards in this process, runs interleaved."""
    from meshnet.models.invariance import ENV
    shards = {}
    for mode in ("auto", "off"):
        previous = os.environ.get(ENV)
        os.environ[ENV] = mode
        try:
            shards[mode] = load(recipe, LayerRange(0, 30), model_path)
        finally:
            os.environ.pop(ENV) if previous is None else os.environ.__setitem__(ENV, previous)
    runs = {(mode, kind): [] for mode in shards for kind in ("solo", "batch")}
    for mode, shard in shards.items():
        decode_rate(shard, story, 4), batch_rate(shard, story, 8, 2)  # warm-up
    for _ in range(args.runs):
        for mode, shard in shards.items():
            runs[mode, "solo"].append(decode_rate(shard, story, args.decode_tokens))
            runs[mode, "batch"].append(batch_rate(shard, story, 8, args.decode_tokens // 2))
    return {key: statistics.median(values) for key, values in runs.items()}


def mesh_rates(recipe: str, prompt_msgs: list[dict], args) -> dict:
    """Decode and prompt tokens/s of a 3-hop mesh in ``recipe``, timed from the client."""
    mesh = LocalMesh(Path(tempfile.mkdtemp(prefix="meshnet-recipes-bench-")), heartbeat_s=1.0)
    dtype = compute_dtype(recipe)
    try:
        mesh.start_tracker(MODEL, node_timeout_s=5.0)
        for name, (start, end) in SPLIT.items():
            # no spot-checks: a drawn session goes hop by hop over HTTP (ADR-0042), another path
            mesh.start_node(name, "--model", MODEL, "--shard-start", str(start), "--shard-end", str(end),
                            "--quantization", recipe, "--dtype", dtype, "--wire-dtype", dtype,
                            "--spot-check-rate", "0", "--speculate", args.speculate, threads=args.threads)
        mesh.wait_routable(MODEL, 300)
        timed_stream(mesh.url, STORY, 4)  # warm-up
        runs = [timed_stream(mesh.url, STORY, args.decode_tokens) for _ in range(args.runs)]
        ttfts = [timed_stream(mesh.url, prompt_msgs, 1)["ttft_s"] for _ in range(args.runs)]
    finally:
        mesh.stop()
    return {"decode": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "decode_runs": [r["decode_tokens_per_s"] for r in runs], "tokens": [r["tokens"] for r in runs],
            "prompt": args.prompt_tokens / statistics.median(ttfts)}


def llama_cpp(args) -> dict | None:
    """llama-bench's prompt and decode tokens/s on ``--gguf`` (None without the binary)."""
    if not (args.llama_bench and args.gguf):
        return None
    out = subprocess.run([args.llama_bench, "-m", args.gguf, "-p", str(args.prompt_tokens), "-n",
                          str(args.decode_tokens), "-t", str(torch.get_num_threads()), "-r", str(args.runs),
                          "-o", "json"], capture_output=True, text=True, check=True, timeout=1800).stdout
    rows = json.loads(out)
    rate = {("prompt" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="bfloat16,int8,int4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each mesh node")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--no-mesh", action="store_true", help="one process only")
    parser.add_argument("--speculate", default="off",
                        help="the mesh nodes' --speculate (default off: the issue's targets are without speculation)")
    parser.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench binary")
    parser.add_argument("--gguf", default=None, help="the GGUF llama-bench runs")
    args = parser.parse_args()
    from meshnet.models.sources import resolve

    model_path = resolve(MODEL)
    recipes = args.recipes.split(",")
    tokenizer = load("bfloat16", LayerRange(0, 1), model_path).tokenizer
    prompt_msgs = prompt_of(tokenizer, args.prompt_tokens)
    prompt, story = chat_ids(tokenizer, prompt_msgs), chat_ids(tokenizer, STORY)
    print(f"recipes on {MODEL}, {os.cpu_count()} CPUs, one process {torch.get_num_threads()} torch threads, "
          f"mesh nodes {args.threads} each; medians of {args.runs}; {args.decode_tokens} decode tokens, "
          f"{len(prompt)}-token prompt")
    reference = one_process("float32", model_path, prompt, story, args) if "float32" in recipes else None
    if reference is None:
        reference = {"final": prefill(load("float32", LayerRange(0, 30), model_path), prompt)[1]}
    figures = {}
    for recipe in recipes:
        fig = reference if recipe == "float32" and "decode" in reference else \
            one_process(recipe, model_path, prompt, story, args)
        fig["distance"] = float((fig["final"] - reference["final"]).norm() / reference["final"].norm())
        fig["invariance"] = invariance_cost(recipe, model_path, story, args)
        fig["mesh"] = None if args.no_mesh else mesh_rates(recipe, prompt_msgs, args)
        figures[recipe] = fig
        print(f"  {recipe} done (load average {os.getloadavg()[0]:.2f})", flush=True)
    print_table(figures, llama_cpp(args))


def print_table(figures: dict, cpp: dict | None) -> None:
    """The recipes side by side, then each target with its verdict."""
    bf16_bytes = figures["bfloat16"]["middle_bytes"] if "bfloat16" in figures else None
    print(f"\n{'recipe':>9} {'1-proc dec':>10} {'1-proc pp':>9} {'3-hop dec':>9} {'3-hop pp':>8} "
          f"{'shard MB':>8} {'x bf16':>6} {'dist f32':>8}  decode runs (1-proc / 3-hop)")
    for recipe, f in figures.items():
        m = f["mesh"]
        ratio = f"{f['middle_bytes'] / bf16_bytes:.3f}" if bf16_bytes else "-"
        print(f"{recipe:>9} {f['decode']:>10.1f} {f['prompt']:>9.0f} {m['decode'] if m else float('nan'):>9.1f} "
              f"{m['prompt'] if m else float('nan'):>8.0f} {f['middle_bytes'] / 1e6:>8.1f} {ratio:>6} "
              f"{f['distance']:>8.4f}  {' '.join(f'{x:.1f}' for x in f['decode_runs'])} / "
              f"{' '.join(f'{x:.1f}' for x in m['decode_runs']) if m else '-'}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("\ncost of batch invariance (ADR-0064), one process, decode tokens/s invariant / not (MESHNET_BATCH_INVARIANT=off)")
    for recipe, f in figures.items():
        c = f["invariance"]
        print(f"{recipe:>9}  1 session {c['auto', 'solo']:.1f} / {c['off', 'solo']:.1f} = "
              f"{c['auto', 'solo'] / c['off', 'solo']:.2f}x   8 sessions {c['auto', 'batch']:.1f} / "
              f"{c['off', 'batch']:.1f} = {c['auto', 'batch'] / c['off', 'batch']:.2f}x")
    best = max(figures, key=lambda r: figures[r]["mesh"]["decode"] if figures[r]["mesh"] else 0.0)
    if figures[best]["mesh"]:
        d = figures[best]["mesh"]["decode"]
        print(f"target: best 3-hop decode ({best}) {d:.1f} >= {RPC_SPLIT_TOKENS_PER_S:.0f} tokens/s "
              f"(the issue's llama.cpp RPC split; its host's figure): {'OK' if d >= RPC_SPLIT_TOKENS_PER_S else 'MISSED'}")
    if "int4" in figures and bf16_bytes:
        r = figures["int4"]["middle_bytes"] / bf16_bytes
        print(f"target: int4 shard weight bytes {r:.3f}x bfloat16 <= {INT4_BYTES_TARGET}: "
              f"{'OK' if r <= INT4_BYTES_TARGET else 'MISSED'}")
    if cpp is None:
        print("llama.cpp: not run (give --llama-bench PATH --gguf PATH)")
    else:
        one = max(f["decode"] for f in figures.values())
        print(f"llama.cpp llama-bench: decode {cpp.get('decode', float('nan')):.1f}, prompt "
              f"{cpp.get('prompt', float('nan')):.0f} tokens/s; best one-process decode {one:.1f} = "
              f"{one / cpp['decode']:.2f}x (target >= 0.5x)")


if __name__ == "__main__":
    main()
