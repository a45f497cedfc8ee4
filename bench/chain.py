"""Chain benchmark: SmolLM2 across 3 real node processes driven as a chain of hop streams
(ADR-0040), against monolithic transformers ``generate`` in the same run.

For each compute dtype (float32 and bfloat16, the wire in the same dtype, the same torch threads
per process everywhere) it prints medians of --runs runs, every timing taken from the client:
  * decode tokens/s over --decode-tokens tokens: (tokens - 1) / (last - first content chunk);
    monolithic from a ``generate`` streamer, its runs interleaved with the mesh's (the model
    loaded in this process while the mesh idles between requests); the ratio of the medians,
    and each chain run's ratio to the monolithic run beside it;
  * time to first token of a 256-token prompt and of a 1,024-token prompt (request sent → first
    content chunk) against the monolithic prefill of the same prompt (logits of the last
    position only, as the entry computes); and the ratios;
  * bytes on the wire per decode token per hop: the growth of the stream bytes received by the
    middle nodes (summed: either may serve a run) and by the tail (their ``/metrics``) from an
    8- to a 40-token generation of the same prompt, over the extra tokens;
  * the stall when the middle node holding the session is frozen (SIGSTOP after token 10): the
    longest gap between tokens after it, with the tokens compared to an undisturbed run.

Beside the chain, a second entry node started ``--no-hop-streams`` (it calls each hop over HTTP
in turn: the fallback path) serves the same middle and tail nodes; its runs alternate with the
chain's, so both see the same load (``--no-star`` leaves it out). Actual token counts are printed beside every
figure. Usage:
  .venv/bin/python bench/chain.py [--runs 3] [--threads 1] [--decode-tokens 48] [--stall-runs 2] [--no-star]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pipeline import MODEL, Monolithic, chat_ids, cpu_bfloat16_capability, prompt_of, timed_stream  # noqa: E402
from meshnet.localmesh import LocalMesh  # noqa: E402

STORY = [{"role": "user", "content": "Tell me about the sea."}]
LONG_STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def node_endpoint(mesh: LocalMesh, name: str) -> str:
    return next(n for n in mesh.get("/v1/nodes")["nodes"] if n["node_id"] == name)["endpoint"]


def stream_bytes_in(mesh: LocalMesh, name: str) -> float:
    text = httpx.get(f"{node_endpoint(mesh, name)}/metrics", timeout=10).text
    match = re.search(r'^meshnet_stream_bytes_total\{direction="in"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def streamed_tokens(url: str, messages, max_tokens: int, on_token=None,
                    meta: dict | None = None) -> tuple[list[int], list[float]]:
    """A greedy streamed chat: the completion token ids and the client time of each content chunk
    (``time.monotonic``); ``meta``, when given, gets the response's ``meshnet`` block."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    times, ids = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                times.append(time.monotonic())
                if on_token is not None:
                    on_token(len(times))
            if event.get("meshnet"):
                ids = event["meshnet"]["completion_token_ids"]
                if meta is not None:
                    meta.update(event["meshnet"])
    return ids, times


def middles(mesh: LocalMesh) -> list[str]:
    return sorted(n for n in mesh.procs if n.startswith("mid-"))


def start_middle(mesh: LocalMesh, name: str, dtype: str, threads: int) -> None:
    mesh.start_node(name, "--model", MODEL, "--shard-start", "10", "--shard-end", "19", "--dtype", dtype,
                    "--wire-dtype", dtype, threads=threads)


def wait_two_middles(mesh: LocalMesh) -> None:
    """Wait until the tracker routes layers 10-29 without any one of the running middles."""
    names = middles(mesh)

    def each_replaceable() -> bool:
        return all(httpx.get(f"{mesh.url}/v1/route", timeout=10, params={
            "model": MODEL, "start_layer": 10, "end_layer": 29, "exclude": name}).status_code == 200 for name in names)

    mesh.wait(each_replaceable, 300, f"a route without each of {names}", interval_s=0.5)


def sigstop_stall(mesh: LocalMesh, url: str, dtype: str, threads: int, serial: list[int]) -> tuple[float, bool, int]:
    """``(longest gap between tokens after the stop, s; tokens identical; tokens)`` for one SIGSTOP
    of the middle node holding the session after token 10. The stopped node is resumed and killed
    (by PID) afterwards, and a fresh middle started in its place."""
    expected, _ = streamed_tokens(url, LONG_STORY, 48)
    stopped: list[str] = []

    def on_token(count: int) -> None:
        if count == 10 and not stopped:
            for name in middles(mesh):
                if httpx.get(f"{node_endpoint(mesh, name)}/v1/health", timeout=5).json()["sessions"] > 0:
                    mesh.signal(name, signal.SIGSTOP)
                    stopped.append(name)
                    return

    try:
        got, times = streamed_tokens(url, LONG_STORY, 48, on_token)
    finally:
        for name in stopped:
            mesh.signal(name, signal.SIGCONT)
            mesh.kill(name)
    if not stopped:
        return float("nan"), False, 0
    serial[0] += 1
    start_middle(mesh, f"mid-{serial[0]}", dtype, threads)
    wait_two_middles(mesh)
    return max(b - a for a, b in zip(times[9:], times[10:])), got == expected, len(got)


def run_mesh(dtype: str, args, prompts: dict, mono: Monolithic) -> tuple[dict, dict | None, dict]:
    """``(chain figures, star figures or None, monolithic figures)`` from one mesh: entry ``entry``
    drives chains, entry ``entry-star`` (started ``--no-hop-streams``) the per-hop HTTP star over
    the same middle and tail nodes, and ``mono`` runs the whole model in this process; their runs
    alternate, so all see the same load. Chats go to each entry directly."""
    mesh = LocalMesh(Path(tempfile.mkdtemp(prefix="meshnet-chain-bench-")), heartbeat_s=1.0)
    out: dict = {}
    star: dict | None = None if args.no_star else {}
    try:
        mesh.start_tracker(MODEL, node_timeout_s=5.0)
        flags = ("--dtype", dtype, "--wire-dtype", dtype)
        # no spot-checks: a drawn session goes hop by hop over HTTP (ADR-0042), another path than
        # the one measured (a drawn 40-token run once read as -3582 stream bytes a token)
        entry_args = ("--model", MODEL, "--shard-start", "0", "--shard-end", "9", *flags, "--spot-check-rate", "0")
        mesh.start_node("entry", *entry_args, threads=args.threads)
        if star is not None:
            mesh.start_node("entry-star", *entry_args, threads=args.threads, env={"MESHNET_HOP_STREAMS": "0"})
        mesh.start_node("tail", "--model", MODEL, "--shard-start", "20", "--shard-end", "29", *flags,
                        threads=args.threads)
        for name in ("mid-a", "mid-b"):
            start_middle(mesh, name, dtype, args.threads)
        wait_two_middles(mesh)
        mesh.wait(lambda: any(n["node_id"] == "entry" for n in mesh.get("/v1/nodes")["nodes"]), 300,
                  "the entry node registered", interval_s=0.5)
        entries = {"chain": node_endpoint(mesh, "entry")}
        if star is not None:
            mesh.wait(lambda: mesh.get(f"/v1/coverage/{MODEL}")["segments"][0]["node_count"] >= 2, 300,
                      "both entries serving layers 0-9", interval_s=0.5)
            entries["star"] = node_endpoint(mesh, "entry-star")
        figures = {"chain": out, "star": star}
        runs: dict = {k: {"decode": [], **{n: [] for n in prompts}} for k in entries}
        mono_runs: dict = {"decode": [], **{n: [] for n in prompts}}
        for url in entries.values():
            timed_stream(url, STORY, 4)  # warm-up: connections, first forwards
        mono.decode_rate(4)
        for _ in range(args.runs):
            for kind, url in entries.items():  # alternating with the monolithic runs: the same load for all
                runs[kind]["decode"].append(timed_stream(url, STORY, args.decode_tokens))
                for n, msgs in prompts.items():
                    runs[kind][n].append(timed_stream(url, msgs, 1)["ttft_s"])
            mono_runs["decode"].append(mono.decode_rate(args.decode_tokens))
            for n, msgs in prompts.items():
                mono_runs[n].append(mono.prefill_s(msgs))
        mono_fig = {"decode_tokens_per_s": statistics.median(mono_runs["decode"]),
                    **{f"prefill_{n}_s": statistics.median(mono_runs[n]) for n in prompts}}
        # each run's ratio against the monolithic run beside it: robust to the load drifting between runs
        out["decode_pair_ratios"] = [c["decode_tokens_per_s"] / m
                                     for c, m in zip(runs["chain"]["decode"], mono_runs["decode"])]
        for kind in entries:
            fig = figures[kind]
            fig["decode_tokens_per_s"] = statistics.median(d["decode_tokens_per_s"] for d in runs[kind]["decode"])
            fig["decode_tokens"] = [d["tokens"] for d in runs[kind]["decode"]]
            for n in prompts:
                fig[f"ttft_{n}_s"] = statistics.median(runs[kind][n])
        url = entries["chain"]
        hops = ["tail"] + middles(mesh)
        before = {h: stream_bytes_in(mesh, h) for h in hops}
        short_run = timed_stream(url, LONG_STORY, 8)
        short = {h: stream_bytes_in(mesh, h) - before[h] for h in hops}
        before = {h: stream_bytes_in(mesh, h) for h in hops}
        long_run = timed_stream(url, LONG_STORY, 40)
        extra = long_run["tokens"] - short_run["tokens"]
        growth = {h: stream_bytes_in(mesh, h) - before[h] - short[h] for h in hops}
        # either middle may serve either run: their sum received each run's steps into layer 10 once
        middle = sum(growth[h] for h in middles(mesh))
        out["bytes_per_token"] = {"middle": middle / extra, "tail": growth["tail"] / extra}
        out["bytes_tokens"] = extra
        serial = [0]
        out["stalls"] = [sigstop_stall(mesh, url, dtype, args.threads, serial) for _ in range(args.stall_runs)]
    finally:
        mesh.stop()
    return out, star, mono_fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (nodes and monolithic)")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--stall-runs", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-star", action="store_true", help="skip the per-hop HTTP star (--no-hop-streams) beside the chain")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from meshnet.models.sources import resolve

    path = resolve(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = {256: prompt_of(tok, 256), 1024: prompt_of(tok, 1024)}
    lengths = {n: len(chat_ids(tok, msgs)) for n, msgs in prompts.items()}
    results = {}
    for dtype in args.dtypes.split(","):
        results[dtype] = run_mesh(dtype, args, prompts, Monolithic(path, args.threads, dtype))

    print(f"\nmeshnet chain benchmark — {MODEL}, 3 hops (entry 0-9, middle 10-19, tail 20-29), "
          f"{args.threads} torch thread(s) per process, median of {args.runs}; provisional: a shared, loaded machine")
    print(cpu_bfloat16_capability())
    print("prompt lengths (tokens, chat template applied): " + ", ".join(f"'{n}' = {lengths[n]}" for n in prompts))
    for dtype, (chain, star, mono) in results.items():
        print(f"\n[{dtype} compute and wire]")
        print(f"{'metric':46} {'chain':>9} {'monolithic':>11} {'ratio':>7} {'star':>9} {'ratio':>7}")

        def row(name: str, c: float, m: float, s: float | None, fmt: str, note: str = "") -> None:
            tail = f" {s:9{fmt}} {s / m:7.2f}" if s is not None else ""
            print(f"{name:46} {c:9{fmt}} {m:11{fmt}} {c / m:7.2f}{tail}{note}")

        row("decode tokens/s", chain["decode_tokens_per_s"], mono["decode_tokens_per_s"],
            star and star["decode_tokens_per_s"], ".2f",
            f"  (tokens per run: chain {chain['decode_tokens']}, star {star and star['decode_tokens']}, "
            f"monolithic {args.decode_tokens})")
        pairs = chain["decode_pair_ratios"]
        print(f"{'':46} decode ratio of each chain run to the monolithic run beside it: "
              f"{', '.join(f'{r:.2f}' for r in pairs)} (median {statistics.median(pairs):.2f})")
        for n in prompts:
            row(f"time to first token, {lengths[n]}-token prompt (s)", chain[f"ttft_{n}_s"], mono[f"prefill_{n}_s"],
                star and star[f"ttft_{n}_s"], ".3f")
        b = chain["bytes_per_token"]
        print(f"bytes on the wire per decode token per hop: middle {b['middle']:.0f}, tail {b['tail']:.0f} "
              f"(over {chain['bytes_tokens']} extra tokens; budget 2 x 576 + 64 = 1216 for bfloat16)")
        for stall, same, tokens in chain["stalls"]:
            print(f"SIGSTOP of the middle after token 10: longest gap {stall:.2f} s, tokens identical: {same} "
                  f"({tokens} tokens)")
        if chain["stalls"]:
            print(f"median SIGSTOP stall: {statistics.median(s for s, _, _ in chain['stalls']):.2f} s")


if __name__ == "__main__":
    main()
