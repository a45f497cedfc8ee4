"""Pipeline benchmark: SmolLM2 across 3 real node processes vs monolithic transformers.

Prints (medians of --runs runs, measured side by side in one run on this machine):
  * decode tokens/s of the 3-node pipeline and of monolithic ``generate`` with KV cache,
    same compute dtype (--dtype, default bfloat16) and the same torch threads per process,
    and their ratio;
  * prefill seconds of a 512- and a 1,024-token prompt: monolithic, 3 hops sequential,
    3 hops pipelined, and the ratios;
  * aggregate decode tokens/s under 1, 4 and 8 concurrent sessions;
  * RSS of a node serving 10 of 30 layers next to a process holding the whole model.

Usage: .venv/bin/python bench/pipeline.py [--runs 3] [--threads 1] [--wire-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.mesh import Mesh  # noqa: E402

MODEL = "smollm2-135m-instruct"
WORDS = ("the quick brown fox jumps over a lazy dog while distant rivers carry old songs to the sea " * 80).split()


def prompt_of(tokenizer, n_tokens: int) -> list[dict]:
    """A user message whose chat-templated length is ``n_tokens`` (trimmed word by word)."""
    lo, hi = 1, len(WORDS)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        msgs = [{"role": "user", "content": " ".join(WORDS[:mid])}]
        if len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return [{"role": "user", "content": " ".join(WORDS[:lo])}]


def chat(url: str, messages, max_tokens: int, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    resp.raise_for_status()
    return resp.json()


def monolithic(model_path: Path, threads: int, runs: int, decode_tokens: int, prompts: dict, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    out = {}
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    rates = []
    for _ in range(runs):
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
            t2 = time.perf_counter()
        rates.append((decode_tokens - 1) / ((t2 - t1) - (t1 - t0)))
    out["decode_tokens_per_s"] = statistics.median(rates)
    for n, msgs in prompts.items():
        pids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        times = []
        for _ in range(runs):
            with torch.inference_mode():
                t0 = time.perf_counter()
                model(pids, use_cache=True)
                times.append(time.perf_counter() - t0)
        out[f"prefill_{n}_s"] = statistics.median(times)
    return out


def whole_model_rss(model_path: Path, dtype: str) -> int:
    """RSS of a process that loads the whole model and runs one short forward (bytes)."""
    code = ("import torch,psutil;from transformers import AutoModelForCausalLM as M;"
            f"m=M.from_pretrained(r'{model_path}',dtype=torch.{dtype});"
            "m(torch.arange(16)[None]);print(psutil.Process().memory_info().rss)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (nodes and monolithic)")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--wire-dtype", default="bfloat16")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype of nodes and of the monolithic model")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from meshnet.models.sources import resolve

    path = resolve(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = {512: prompt_of(tok, 512), 1024: prompt_of(tok, 1024)}
    story = [{"role": "user", "content": "Tell me about the sea."}]
    mesh = Mesh(Path(tempfile.mkdtemp(prefix="meshnet-bench-")), heartbeat_s=1.0)
    try:
        mesh.start_tracker(MODEL)
        for i, (a, b) in enumerate([(0, 9), (10, 19), (20, 29)]):
            mesh._spawn(f"node-{i}", ["node", "start", "--tracker", mesh.url, "--node-id", f"node-{i}",
                                      "--model", MODEL, "--shard-start", str(a), "--shard-end", str(b),
                                      "--threads", str(args.threads), "--wire-dtype", args.wire_dtype, "--dtype", args.dtype,
                                      "--heartbeat-interval", "1"])
        mesh.wait_routable(MODEL, 300)
        chat(mesh.url, story, 4)  # warm-up
        node_health = [httpx.get(f"{n['endpoint']}/v1/health", timeout=10).json()
                       for n in mesh.get("/v1/nodes")["nodes"]]  # RSS after one short request
        pipe = {"decode_tokens_per_s": statistics.median(
            chat(mesh.url, story, args.decode_tokens)["meshnet"]["decode_tokens_per_s"] for _ in range(args.runs))}
        for n, msgs in prompts.items():
            for mode, flag in (("pipelined", True), ("sequential", False)):
                pipe[f"prefill_{n}_{mode}_s"] = statistics.median(
                    chat(mesh.url, msgs, 1, pipelined_prefill=flag)["meshnet"]["prefill_s"] for _ in range(args.runs))
        concurrency = {}
        for sessions in (1, 4, 8):
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(sessions) as pool:
                results = list(pool.map(lambda i: chat(mesh.url, [{"role": "user", "content": f"Count to {i + 5}."}],
                                                       32), range(sessions)))
            tokens = sum(r["usage"]["completion_tokens"] for r in results)
            concurrency[sessions] = tokens / (time.perf_counter() - t0)
    finally:
        mesh.stop()
    mono = monolithic(path, args.threads, args.runs, args.decode_tokens, prompts, args.dtype)
    whole_rss = whole_model_rss(path, args.dtype)

    print(f"\nmeshnet pipeline benchmark — {MODEL}, {args.dtype} compute, {args.wire_dtype} wire, "
          f"{args.threads} torch thread(s) per process, median of {args.runs}")
    print(f"{'metric':44} {'pipeline':>10} {'monolithic':>11} {'ratio':>7}")
    d_ratio = pipe["decode_tokens_per_s"] / mono["decode_tokens_per_s"]
    print(f"{'decode tokens/s':44} {pipe['decode_tokens_per_s']:10.2f} {mono['decode_tokens_per_s']:11.2f} "
          f"{d_ratio:7.2f}  (target >= 0.80)")
    for n in prompts:
        for mode in ("sequential", "pipelined"):
            v = pipe[f"prefill_{n}_{mode}_s"]
            print(f"{f'prefill {n} tokens, 3 hops {mode} (s)':44} {v:10.3f} {mono[f'prefill_{n}_s']:11.3f} "
                  f"{v / mono[f'prefill_{n}_s']:7.2f}" + ("  (target <= 1.30)" if mode == "pipelined" else ""))
    for s, rate in concurrency.items():
        print(f"{f'aggregate decode tokens/s, {s} session(s)':44} {rate:10.2f}")
    for h in node_health:
        layers = h["shards"][0]
        print(f"RSS {h['node_id']} (layers {layers['shard_start']}-{layers['shard_end']}): "
              f"{h['rss_bytes'] / 2**20:8.1f} MiB   whole-model process: {whole_rss / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
