"""The tracker as entry (ADR-0044) against the tracker as proxy, client-timed, one sitting.

Two local meshes of SmolLM2 split 0-9 / 10-19 / 20-29, one after the other, same compute dtype
and one torch thread per process:
  * ``tracker-entry``: the tracker serves 0-9 itself (``--serve-layers``) plus two node processes;
    a chat at the tracker is answered in-process;
  * ``proxy``: a tracker without layers plus three node processes; the tracker forwards the chat
    to the entry node and relays its stream.
For each it prints the medians over ``--runs`` streamed greedy chats of: time to first token
(request sent → first content chunk), total time, decode tokens/s from the stream, and the
actual completion token count, then the ratios tracker-entry / proxy, and whether both gave
the same tokens.

Usage: .venv/bin/python bench/tracker_entry.py [--runs 7] [--max-tokens 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshnet.localmesh import LocalMesh  # noqa: E402

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
SHARDS = [(0, 9), (10, 19), (20, 29)]


def streamed(url: str, max_tokens: int) -> dict:
    """One greedy streamed chat: first-token and total seconds, decode tokens/s, token ids, route."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    count, final = 0, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                count += 1
            final = chunk.get("meshnet") or final
    total = time.perf_counter() - t0
    return {"ttft_s": first - t0, "total_s": total,
            "decode_tokens_per_s": (count - 1) / (last - first) if count > 1 and last > first else 0.0,
            "tokens": final["completion_token_ids"], "route": [h["node_id"] for h in final["route"]]}


def run_mesh(layout: str, args, logs: Path) -> dict:
    mesh = LocalMesh(logs / layout, heartbeat_s=1.0)
    compute = ["--dtype", args.dtype, "--wire-dtype", args.dtype]
    try:
        own = ["--serve-layers", "0-9", "--threads", "1", *compute] if layout == "tracker-entry" else []
        mesh.start_tracker(MODEL, node_timeout_s=25.0, rebalance_s=30.0, extra=own)
        for i, (a, b) in enumerate(SHARDS):
            if layout == "tracker-entry" and i == 0:
                continue
            mesh.start_node(f"node-{i}", "--model", MODEL, "--shard-start", str(a), "--shard-end", str(b), *compute,
                            threads=1)
        mesh.wait_routable(MODEL, 300)
        streamed(mesh.url, 4)  # warm-up: first route lookup, first session on every hop
        runs = [streamed(mesh.url, args.max_tokens) for _ in range(args.runs)]
    finally:
        mesh.stop()
    return {"route": runs[0]["route"], "tokens": runs[0]["tokens"], "same_tokens_every_run":
            all(r["tokens"] == runs[0]["tokens"] for r in runs),
            **{k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "total_s", "decode_tokens_per_s")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-") as tmp:
        results = {layout: run_mesh(layout, args, Path(tmp)) for layout in ("tracker-entry", "proxy")}
    for layout, r in results.items():
        print(f"{layout:>13}: route {' > '.join(r['route'])}; {len(r['tokens'])} tokens; "
              f"TTFT {r['ttft_s'] * 1000:.1f} ms, total {r['total_s']:.3f} s, decode {r['decode_tokens_per_s']:.1f} "
              f"tokens/s (medians of {args.runs}, {args.dtype}, 1 thread per process)")
    a, b = results["tracker-entry"], results["proxy"]
    print(f"tracker-entry / proxy: TTFT {a['ttft_s'] / b['ttft_s']:.2f}x, total {a['total_s'] / b['total_s']:.2f}x, "
          f"decode {a['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x; same tokens: "
          f"{a['tokens'] == b['tokens']}")


if __name__ == "__main__":
    main()
