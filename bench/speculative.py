"""Speculative decoding benchmark (ADR-0058): SmolLM2 across 3 node processes, one session at a time
and 8 at once, with speculation (``--speculate auto``, the default) and without, against monolithic
transformers ``generate`` with and without its own prompt lookup, in the same sitting.

One mesh: a tracker, two entry nodes on layers 0-9 (``entry`` with ``--speculate auto``,
``entry-off`` with ``--speculate off``), a middle node on 10-19 and a tail on 20-29; chats go to
each entry directly, so both speculate-on and -off runs cross the same three processes' layers.
The whole model also runs in this process (``generate``, greedy, the same dtype and threads);
its runs alternate with the mesh's, so all see the same load.

Two tasks: (a) an edit whose answer copies much of its prompt (type hints for a 200+ token
function) and (b) free text (a story). Decode tokens/s from the client: (tokens - 1) / (last -
first content chunk), medians of --runs. Printed: each figure, the ratios the issue asks
(speculation ÷ monolithic ``generate``, ÷ ``generate`` with ``prompt_lookup_num_tokens``, and
÷ the same mesh with speculation off), tokens per traversal beside the speculative figures, and
with --concurrent N (default 8) the aggregate tokens/s of N sessions at once on each entry.

Usage:
  .venv/bin/python bench/speculative.py [--runs 3] [--threads 1] [--dtype float32] [--decode-tokens 128]
                                        [--concurrent 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.chain import streamed_tokens  # noqa: E402
from bench.pipeline import MODEL, TokenClock  # noqa: E402
from meshnet.localmesh import LocalMesh  # noqa: E402

CODE = '''def summarize_orders(orders, customers, discount_rate, minimum_total):
    report = {}
    for order in orders:
        customer = customers.get(order["customer_id"])
        if customer is None:
            continue
        total = 0
        for item in order["items"]:
            price = item["price"] * item["quantity"]
            if item.get("on_sale"):
                price = price * (1 - discount_rate)
            total = total + price
        if total < minimum_total:
            continue
        name = customer["name"]
        if name not in report:
            report[name] = {"orders": 0, "total": 0}
        report[name]["orders"] = report[name]["orders"] + 1
        report[name]["total"] = report[name]["total"] + total
    return report
'''
TASKS = {"edit": [{"role": "user", "content": f"Add type hints to this function:\n\n{CODE}"}],
         "free": [{"role": "user", "content": "Write a story about a lighthouse keeper."}]}
#: the draft length transformers' documentation suggests for ``prompt_lookup_num_tokens``
PLD_TOKENS = 10


def stream(url: str, messages, max_tokens: int) -> dict:
    """One greedy streamed chat: ``{"rate", "tokens", "per_traversal"}`` timed at the client."""
    meta: dict = {}
    ids, times = streamed_tokens(url, messages, max_tokens, meta=meta)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"rate": (len(ids) - 1) / span if span > 0 else float("nan"), "tokens": len(ids),
            "per_traversal": (meta.get("speculation") or {}).get("tokens_per_traversal", 0.0)}


def concurrent(url: str, messages, max_tokens: int, sessions: int) -> float:
    """Aggregate decode tokens/s of ``sessions`` chats at once: all their tokens over the wall time."""
    results: list[dict] = []

    def one() -> None:
        results.append(stream(url, messages, max_tokens))

    threads = [threading.Thread(target=one) for _ in range(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(r["tokens"] for r in results) / (time.perf_counter() - t0)


class Whole:
    """The whole model in this process: ``generate``, greedy, plain or with prompt lookup."""

    def __init__(self, model_path: Path, dtype: str, threads: int) -> None:
        import torch
        from transformers import AutoTokenizer

        from meshnet.models.checkpoints import whole_model

        torch.set_num_threads(threads)
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = whole_model(model_path, getattr(torch, dtype))

    def rate(self, messages, max_tokens: int, lookup: bool) -> float:
        import torch

        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
        clock = TokenClock()
        extra = {"prompt_lookup_num_tokens": PLD_TOKENS} if lookup else {}
        with torch.inference_mode():
            self.model.generate(ids, max_new_tokens=max_tokens, do_sample=False, streamer=clock, **extra)
        return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])


def start(args) -> tuple[LocalMesh, dict[str, str]]:
    mesh = LocalMesh(Path(tempfile.mkdtemp(prefix="meshnet-spec-bench-")), heartbeat_s=1.0)
    mesh.start_tracker(MODEL, node_timeout_s=5.0)
    flags = ("--model", MODEL, "--dtype", args.dtype, "--wire-dtype", args.dtype, "--spot-check-rate", "0")
    for name, (a, b), extra in (("entry", (0, 9), ("--speculate", "auto")),
                                ("entry-off", (0, 9), ("--speculate", "off")), ("mid", (10, 19), ()),
                                ("tail", (20, 29), ())):
        mesh.start_node(name, *flags, "--shard-start", str(a), "--shard-end", str(b), *extra, threads=args.threads)
    mesh.wait(lambda: mesh.get(f"/v1/coverage/{MODEL}")["segments"][0]["node_count"] >= 2
              and mesh.get(f"/v1/coverage/{MODEL}")["routable"], 300, "both entries serving", interval_s=0.5)
    nodes = {n["node_id"]: n["endpoint"] for n in mesh.get("/v1/nodes")["nodes"]}
    return mesh, {"spec": nodes["entry"], "off": nodes["entry-off"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--concurrent", type=int, default=8)
    args = parser.parse_args()
    from meshnet.models.sources import model_dir

    whole = Whole(model_dir(MODEL), args.dtype, args.threads)
    mesh, entries = start(args)
    try:
        figures = {task: {k: [] for k in ("spec", "off", "mono", "pld", "per_traversal")} for task in TASKS}
        for url in entries.values():
            stream(url, TASKS["free"], 4)  # warm-up
        for _ in range(args.runs):
            for task, messages in TASKS.items():
                spec = stream(entries["spec"], messages, args.decode_tokens)
                figures[task]["spec"].append(spec["rate"])
                figures[task]["per_traversal"].append(spec["per_traversal"])
                figures[task]["off"].append(stream(entries["off"], messages, args.decode_tokens)["rate"])
                figures[task]["mono"].append(whole.rate(messages, args.decode_tokens, lookup=False))
                figures[task]["pld"].append(whole.rate(messages, args.decode_tokens, lookup=True))
        print(f"SmolLM2-135M, {args.dtype}, {args.threads} thread(s) a process, {args.decode_tokens} tokens, "
              f"medians of {args.runs}; load average {os.getloadavg()[0]:.2f}")
        print(f"{'task':<6} {'spec tok/s':>10} {'tok/trav':>8} {'off':>7} {'generate':>9} {'gen+PLD':>8}  "
              f"{'spec/gen':>8} {'spec/PLD':>8} {'spec/off':>8}")
        for task, f in figures.items():
            m = {k: statistics.median(v) for k, v in f.items()}
            print(f"{task:<6} {m['spec']:>10.1f} {m['per_traversal']:>8.2f} {m['off']:>7.1f} {m['mono']:>9.1f} "
                  f"{m['pld']:>8.1f}  {m['spec'] / m['mono']:>8.2f} {m['spec'] / m['pld']:>8.2f} "
                  f"{m['spec'] / m['off']:>8.2f}")
        print("targets: edit spec/gen >= 2.0 and spec/PLD > 1.0; free spec/off >= 0.95")
        if args.concurrent:
            print(f"\n{args.concurrent} sessions at once, aggregate tokens/s (median of {args.runs}):")
            for task, messages in TASKS.items():
                on = statistics.median(concurrent(entries["spec"], messages, args.decode_tokens, args.concurrent)
                                       for _ in range(args.runs))
                off = statistics.median(concurrent(entries["off"], messages, args.decode_tokens, args.concurrent)
                                        for _ in range(args.runs))
                print(f"{task:<6} spec {on:7.1f}  off {off:7.1f}  spec/off {on / off:5.2f}  (target >= 1.0)")
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
