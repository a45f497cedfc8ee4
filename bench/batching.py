"""Batching and compute-parity benchmark (ADR-0041): SmolLM2-135M on this machine.

Prints, measured side by side in one sitting:

  * **per-layer decode compute**: a node's ShardModel running layers 10-19 (its own KV cache,
    one decode step per call) against the same ten layers inside the monolithic transformers
    model (timed by hooks on layers 10 and 19 during its own decode), same torch threads, in
    float32 and bfloat16; milliseconds per layer per token, medians of ``--runs`` interleaved
    runs of ``--steps`` steps each, after a ``--context``-token prefill; and the node's batched
    step of 8 sessions per layer per token;
  * **aggregate decode over the mesh**: three node processes, streamed greedy chats timed by the
    client: decode tokens/s of one session, and of 8 concurrent sessions together
    (sum of (tokens - 1) over the span from the first session's first token to the last
    session's last token), with the actual token counts; and monolithic ``generate`` at batch 1
    and batch 8 beside them.

The machine is shared: read the ratios, measured side by side, not the absolute figures.

Usage: PYTHONPATH=. .venv/bin/python bench/batching.py [--runs 5] [--threads 1] [--dtype float32]
       [--skip-mesh] [--skip-parity]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pipeline import timed_stream  # noqa: E402
from meshnet.localmesh import LocalMesh  # noqa: E402

MODEL = "smollm2-135m-instruct"
LAYERS = (10, 20)  # a middle node's half-open range
TOPICS = ["the sea", "a robot who learns to paint", "why the sky is blue", "the history of bread",
          "bicycles in old cities", "a cat who guards a lighthouse", "a mountain village in winter", "rain forests"]


# ---- per-layer compute parity -------------------------------------------------------------


class MonolithicDecoder:
    """The monolithic model decoding one session; :meth:`step` returns the seconds its layers
    10-19 took for one token (hooks on the first and the last of them)."""

    def __init__(self, model, context: int) -> None:
        import torch
        from transformers import DynamicCache

        self.model, self.marks = model, []
        blocks = model.model.layers
        self.hooks = [blocks[LAYERS[0]].register_forward_pre_hook(lambda *_: self.marks.append(time.perf_counter())),
                      blocks[LAYERS[1] - 1].register_forward_hook(lambda *_: self.marks.append(time.perf_counter()))]
        self.cache = DynamicCache(config=model.config)
        ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            model(ids, past_key_values=self.cache, use_cache=True)
        self.token = ids[:, -1:]

    def step(self) -> float:
        import torch

        self.marks.clear()
        with torch.inference_mode():
            self.model(self.token, past_key_values=self.cache, use_cache=True)
        return self.marks[1] - self.marks[0]

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


class NodeDecoder:
    """A node's ShardModel (layers 10-19) decoding ``sessions`` sessions of different lengths at
    once; :meth:`step` returns the seconds of one decode step of all of them."""

    def __init__(self, shard, context: int, sessions: int = 1) -> None:
        import torch

        from meshnet.models.caches import KVCache

        self.shard, self.gen = shard, torch.Generator().manual_seed(1)
        self.caches = [KVCache() for _ in range(sessions)]
        self.positions = [context + 7 * i for i in range(sessions)]  # ragged when batched
        for cache, length in zip(self.caches, self.positions):
            shard.forward(torch.randn(1, length, shard.config.hidden_size, generator=self.gen), cache, 0)

    def step(self) -> float:
        import torch

        hidden = torch.randn(len(self.caches), 1, self.shard.config.hidden_size, generator=self.gen)
        t0 = time.perf_counter()
        if len(self.caches) == 1:
            self.shard.forward(hidden, self.caches[0], self.positions[0])
        else:
            self.shard.forward_batch(hidden, self.caches, self.positions)
        span = time.perf_counter() - t0
        self.positions = [p + 1 for p in self.positions]
        return span


def parity(path: Path, threads: int, runs: int, steps: int, context: int) -> list[str]:
    import torch
    from meshnet.models.checkpoints import whole_model

    from meshnet.layers import LayerRange
    from meshnet.models.shard import ShardModel

    torch.set_num_threads(threads)
    lines = [f"{'per-layer decode, ms per layer per token':44} {'node':>8} {'monolithic':>11} {'ratio':>7} "
             f"{'node batch 8':>13}"]
    for dtype in ("float32", "bfloat16"):
        model = whole_model(path, getattr(torch, dtype))
        shard = ShardModel(path, LayerRange(*LAYERS), dtype=dtype)
        mono, node, batch = [], [], []
        layers = LAYERS[1] - LAYERS[0]
        for _ in range(runs):  # steps interleaved one by one, so load on the machine hits all alike
            decoders = (MonolithicDecoder(model, context), NodeDecoder(shard, context),
                        NodeDecoder(shard, context, sessions=8))
            spans: list[list[float]] = [[], [], []]
            for _ in range(steps):
                for decoder, out in zip(decoders, spans):
                    out.append(decoder.step())
            decoders[0].close()
            mono.append(statistics.median(spans[0]) * 1000 / layers)
            node.append(statistics.median(spans[1]) * 1000 / layers)
            batch.append(statistics.median(spans[2]) * 1000 / layers / 8)
        m, n, b = statistics.median(mono), statistics.median(node), statistics.median(batch)
        lines.append(f"{f'{dtype}, layers 10-19, {context}-token context':44} {n:8.3f} {m:11.3f} {n / m:7.2f} "
                     f"{b:13.3f}  (target ratio <= 1.10)")
        del model, shard
    return lines


# ---- aggregate decode over the mesh ------------------------------------------------------


def story_stream(url: str, topic: str, max_tokens: int) -> dict:
    """One greedy streamed chat about ``topic`` (:func:`bench.pipeline.timed_stream`: chunk times, tokens)."""
    return timed_stream(url, [{"role": "user", "content": f"Write a long story about {topic}."}], max_tokens)


def aggregate_rate(streams: list[dict]) -> tuple[float, int]:
    """(decode tokens/s of the streams together, completion tokens in all)."""
    first = min(s["times"][0] for s in streams)
    last = max(s["times"][-1] for s in streams)
    decoded = sum(s["tokens"] - 1 for s in streams)
    return decoded / (last - first), sum(s["tokens"] for s in streams)


def mesh_rates(dtype: str, threads: int, runs: int, max_tokens: int, sessions: int, window_ms: float) -> dict:
    mesh = LocalMesh(Path(tempfile.mkdtemp(prefix="meshnet-bench-batching-")), heartbeat_s=1.0)
    out: dict = {"one": [], "many": [], "one_tokens": [], "many_tokens": []}
    try:
        mesh.start_tracker(MODEL)
        for i, (a, b) in enumerate([(0, 9), (10, 19), (20, 29)]):
            mesh.start_node(f"node-{i}", "--model", MODEL, "--shard-start", str(a), "--shard-end", str(b),
                            "--dtype", dtype, "--wire-dtype", dtype, "--batch-window-ms", str(window_ms),
                            threads=threads)
        mesh.wait_routable(MODEL, 300)
        story_stream(mesh.url, "warm-up", 4)
        for _ in range(runs):
            rate, tokens = aggregate_rate([story_stream(mesh.url, TOPICS[0], max_tokens)])
            out["one"].append(rate)
            out["one_tokens"].append(tokens)
            with cf.ThreadPoolExecutor(sessions) as pool:
                streams = list(pool.map(lambda t: story_stream(mesh.url, t, max_tokens), TOPICS[:sessions]))
            rate, tokens = aggregate_rate(streams)
            out["many"].append(rate)
            out["many_tokens"].append(tokens)
        out["batch_sizes"] = [_batch_mean(n["endpoint"]) for n in mesh.get("/v1/nodes")["nodes"]]
    finally:
        mesh.stop()
    return out


def _batch_mean(endpoint: str) -> float:
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in httpx.get(f"{endpoint}/metrics", timeout=10).text.splitlines()
               if line.startswith("meshnet_node_batch_size_")}
    return samples["meshnet_node_batch_size_sum"] / max(1.0, samples["meshnet_node_batch_size_count"])


def monolithic_rates(path: Path, dtype: str, threads: int, runs: int, max_tokens: int, sessions: int) -> dict:
    """Monolithic ``generate`` decode tokens/s at batch 1 and batch ``sessions`` (left-padded prompts):
    (batch x (new tokens - 1)) / (time of ``max_tokens`` new tokens - time of 1)."""
    import torch
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = whole_model(path, getattr(torch, dtype))
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Write a long story about {t}."}],
                                     add_generation_prompt=True, tokenize=False) for t in TOPICS[:sessions]]

    def timed(batch: list[str], new: int) -> float:
        inputs = tok(batch, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=tok.pad_token_id or tok.eos_token_id)
        return time.perf_counter() - t0

    out = {}
    for label, batch in (("one", texts[:1]), ("many", texts)):
        rates = []
        for _ in range(runs):
            span = timed(batch, max_tokens) - timed(batch, 1)
            rates.append(len(batch) * (max_tokens - 1) / span)
        out[label] = statistics.median(rates)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (nodes and monolithic)")
    ap.add_argument("--dtype", default="float32", help="compute dtype of the mesh and monolithic generate")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per parity run")
    ap.add_argument("--context", type=int, default=128, help="tokens cached before the parity runs")
    ap.add_argument("--batch-window-ms", type=float, default=5.0, help="the nodes' batch window")
    ap.add_argument("--skip-mesh", action="store_true")
    ap.add_argument("--skip-parity", action="store_true")
    args = ap.parse_args()

    from meshnet.models.sources import resolve

    path = resolve(MODEL)
    print(f"\nmeshnet batching benchmark — {MODEL}, {args.threads} torch thread(s) per process, "
          f"medians of {args.runs} runs; provisional on a shared machine, read the ratios")
    if not args.skip_parity:
        for line in parity(path, args.threads, args.runs, args.steps, args.context):
            print(line, flush=True)
    if args.skip_mesh:
        return
    mesh = mesh_rates(args.dtype, args.threads, args.runs, args.max_tokens, args.sessions, args.batch_window_ms)
    mono = monolithic_rates(path, args.dtype, args.threads, args.runs, args.max_tokens, args.sessions)
    one, many = statistics.median(mesh["one"]), statistics.median(mesh["many"])
    print(f"{f'aggregate decode tokens/s, {args.dtype}':44} {'1 session':>10} {f'{args.sessions} sessions':>11} "
          f"{'ratio':>7}")
    print(f"{f'3-node mesh, {args.batch_window_ms:g} ms window (client-timed)':44} {one:10.2f} {many:11.2f} {many / one:7.2f}  (target >= 4)")
    print(f"{'monolithic generate (batch 1 / batch 8)':44} {mono['one']:10.2f} {mono['many']:11.2f} "
          f"{mono['many'] / mono['one']:7.2f}")
    print(f"completion tokens per run: 1 session {mesh['one_tokens']}, {args.sessions} sessions {mesh['many_tokens']}")
    print("mean steps per forward on each node: " + ", ".join(f"{b:.2f}" for b in mesh["batch_sizes"]))


if __name__ == "__main__":
    main()
