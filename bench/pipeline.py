"""Pipeline benchmark: SmolLM2 across 3 real node processes vs monolithic transformers.

Prints (medians of --runs runs, measured side by side in one run on this machine), with the
CPU's bfloat16 capability and the actual prompt lengths in tokens:
  * decode tokens/s of the 3-node pipeline and of monolithic ``generate`` with KV cache,
    same compute dtype (--dtype, default bfloat16) and the same torch threads per process,
    and their ratio; both timed from the caller: (tokens - 1) / (last token time - first
    token time), the pipeline from its SSE stream, the baseline from a ``generate`` streamer;
  * time to first token, prefill of a 512- and a 1,024-token prompt: monolithic (logits for
    the last position only, as the entry node computes), 3 hops sequential, 3 hops pipelined,
    and the ratios; the pipeline's from the client (request sent → first content chunk);
  * aggregate decode tokens/s under 1, 4 and 8 concurrent sessions;
  * RSS of a node serving 10 of 30 layers next to a process holding the whole model.

Usage: .venv/bin/python bench/pipeline.py [--runs 3] [--threads 1] [--wire-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshnet.localmesh import LocalMesh  # noqa: E402

MODEL = "smollm2-135m-instruct"
WORDS = ("the quick brown fox jumps over a lazy dog while distant rivers carry old songs to the sea " * 80).split()


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` under the chat template (generation prompt added)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def prompt_of(tokenizer, n_tokens: int) -> list[dict]:
    """A user message whose chat-templated length is at most ``n_tokens`` (trimmed word by word)."""
    lo, hi = 1, len(WORDS)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        msgs = [{"role": "user", "content": " ".join(WORDS[:mid])}]
        if len(chat_ids(tokenizer, msgs)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return [{"role": "user", "content": " ".join(WORDS[:lo])}]


def chat(url: str, messages, max_tokens: int, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    resp.raise_for_status()
    return resp.json()


def timed_stream(url: str, messages, max_tokens: int, **extra) -> dict:
    """One streamed chat, timed from the client.

    Returns ``{"ttft_s", "decode_tokens_per_s", "tokens", "times"}``: request sent → first content
    chunk, (completion tokens - 1) / (last content chunk - first content chunk), and the
    ``perf_counter`` time of every content chunk.
    """
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    times, usage = [], {}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                times.append(time.perf_counter())
    tokens = usage.get("completion_tokens", len(times))
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"ttft_s": times[0] - t0 if times else float("nan"), "tokens": tokens,
            "decode_tokens_per_s": (tokens - 1) / span if span > 0 else float("nan"), "times": times}


class TokenClock:
    """A ``generate`` streamer that records when each new token arrives (perf_counter seconds)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first puts the prompt ids
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class Monolithic:
    """The baseline: the whole model in this process, transformers ``generate`` with KV cache, in
    compute dtype ``dtype`` with ``threads`` torch threads. Its runs can be interleaved with the
    mesh's, so both are measured under the same load."""

    def __init__(self, model_path: Path, threads: int, dtype: str) -> None:
        import torch
        from transformers import AutoTokenizer

        from meshnet.models.checkpoints import whole_model

        torch.set_num_threads(threads)
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = whole_model(model_path, getattr(torch, dtype))
        self.story = self.tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                                  add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]

    def decode_rate(self, decode_tokens: int) -> float:
        """Decode tokens/s of one greedy ``generate`` of ``decode_tokens`` tokens, from its streamer:
        (tokens - 1) / (last token time - first token time)."""
        import torch

        clock = TokenClock()
        with torch.inference_mode():
            self.model.generate(self.story, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens,
                                do_sample=False, streamer=clock)
        return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])

    def prefill_s(self, messages: list[dict]) -> float:
        """Seconds of one prefill of ``messages`` (logits of the last position only, as the entry computes)."""
        import torch

        pids = torch.tensor([chat_ids(self.tok, messages)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model(pids, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0


def monolithic(model_path: Path, threads: int, runs: int, decode_tokens: int, prompts: dict, dtype: str) -> dict:
    """Medians of ``runs`` runs of :class:`Monolithic`: ``decode_tokens_per_s`` and ``prefill_<n>_s`` per prompt."""
    mono = Monolithic(model_path, threads, dtype)
    out = {"decode_tokens_per_s": statistics.median(mono.decode_rate(decode_tokens) for _ in range(runs))}
    for n, msgs in prompts.items():
        out[f"prefill_{n}_s"] = statistics.median(mono.prefill_s(msgs) for _ in range(runs))
    return out


def whole_model_rss(model_path: Path, dtype: str) -> int:
    """RSS of a process that loads the whole model and runs one short forward (bytes)."""
    code = ("import torch,psutil;from transformers import AutoModelForCausalLM as M;"
            f"m=M.from_pretrained(r'{model_path}',dtype=torch.{dtype});"
            "m(torch.arange(16)[None]);print(psutil.Process().memory_info().rss)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def cpu_bfloat16_capability() -> str:
    """What this CPU offers for bfloat16: torch's kernel level and the cpuinfo flags that matter."""
    import torch

    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split() if f in ("avx512_bf16", "amx_bf16", "amx_tile")]
                break
    except OSError:
        pass
    return f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, bf16 flags: {', '.join(flags) or 'none'}"


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
    lengths = {n: len(chat_ids(tok, msgs)) for n, msgs in prompts.items()}
    story = [{"role": "user", "content": "Tell me about the sea."}]
    mesh = LocalMesh(Path(tempfile.mkdtemp(prefix="meshnet-bench-")), heartbeat_s=1.0)
    try:
        mesh.start_tracker(MODEL)
        for i, (a, b) in enumerate([(0, 9), (10, 19), (20, 29)]):
            mesh.start_node(f"node-{i}", "--model", MODEL, "--shard-start", str(a), "--shard-end", str(b),
                            "--wire-dtype", args.wire_dtype, "--dtype", args.dtype, threads=args.threads)
        mesh.wait_routable(MODEL, 300)
        chat(mesh.url, story, 4)  # warm-up
        node_health = [httpx.get(f"{n['endpoint']}/v1/health", timeout=10).json()
                       for n in mesh.get("/v1/nodes")["nodes"]]  # RSS after one short request
        pipe = {"decode_tokens_per_s": statistics.median(
            timed_stream(mesh.url, story, args.decode_tokens)["decode_tokens_per_s"] for _ in range(args.runs))}
        for n, msgs in prompts.items():
            for mode, flag in (("pipelined", True), ("sequential", False)):
                pipe[f"prefill_{n}_{mode}_s"] = statistics.median(
                    timed_stream(mesh.url, msgs, 1, pipelined_prefill=flag)["ttft_s"] for _ in range(args.runs))
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
    print(cpu_bfloat16_capability())
    print("prompt lengths (tokens, chat template applied): "
          + ", ".join(f"'{n}' = {lengths[n]}" for n in prompts))
    print(f"{'metric':44} {'pipeline':>10} {'monolithic':>11} {'ratio':>7}")
    d_ratio = pipe["decode_tokens_per_s"] / mono["decode_tokens_per_s"]
    print(f"{'decode tokens/s':44} {pipe['decode_tokens_per_s']:10.2f} {mono['decode_tokens_per_s']:11.2f} "
          f"{d_ratio:7.2f}  (target >= 0.80)")
    for n in prompts:
        for mode in ("sequential", "pipelined"):
            v = pipe[f"prefill_{n}_{mode}_s"]
            print(f"{f'first token, {lengths[n]}-token prompt, {mode} (s)':44} {v:10.3f} {mono[f'prefill_{n}_s']:11.3f} "
                  f"{v / mono[f'prefill_{n}_s']:7.2f}" + ("  (target <= 1.30)" if mode == "pipelined" else ""))
    for s, rate in concurrency.items():
        print(f"{f'aggregate decode tokens/s, {s} session(s)':44} {rate:10.2f}")
    for h in node_health:
        layers = h["shards"][0]
        print(f"RSS {h['node_id']} (layers {layers['shard_start']}-{layers['shard_end']}): "
              f"{h['rss_bytes'] / 2**20:8.1f} MiB   whole-model process: {whole_rss / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
