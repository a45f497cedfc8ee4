"""Structured outputs benchmark (ADR-0053): decode speed of a session constrained to a JSON
schema against a free one, on one real node serving all of SmolLM2 (float32, 1 thread), requests
alternated so both see the same load. Prints the medians of --runs runs and their ratio (issue
26's budget: the constrained session pays under 10 %).

Usage: .venv/bin/python bench/structured.py [--runs 5] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshnet.localmesh import LocalMesh  # noqa: E402

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Describe a lighthouse keeper as JSON with a name, an age and a long "
                                   "list of daily tasks."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tasks": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tasks"]}


def run(url: str, tokens: int, constrained: bool) -> tuple[float, int]:
    body = {"model": MODEL, "messages": ASK, "max_tokens": tokens, "temperature": 0}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "keeper", "schema": SCHEMA}}
    data = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
    return data["meshnet"]["decode_tokens_per_s"], data["usage"]["completion_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshnet-structured-") as tmp:
        mesh = LocalMesh(Path(tmp) / "logs", heartbeat_s=5.0)
        try:
            mesh.start_tracker(MODEL)
            mesh.start_node("entry", "--model", MODEL, "--shard-start", "0", "--shard-end", "29", "--dtype", "float32",
                            "--wire-dtype", "float32", "--spot-check-rate", "0")
            mesh.wait_routable(MODEL, 600)
            run(mesh.url, 8, False), run(mesh.url, 8, True)  # warm: first calls, the grammar tokenizer
            free, constrained = [], []
            for _ in range(args.runs):
                free.append(run(mesh.url, args.tokens, False))
                constrained.append(run(mesh.url, args.tokens, True))
        finally:
            mesh.stop()
    f, c = statistics.median(r for r, _ in free), statistics.median(r for r, _ in constrained)
    print(f"meshnet structured outputs: {MODEL}, one node, float32, medians of {args.runs} alternated runs")
    print(f"decode tokens/s  free {f:.2f}  json_schema {c:.2f}  ratio {c / f:.3f}  (budget >= 0.90)")
    print(f"tokens per run: free {[n for _, n in free]}, json_schema {[n for _, n in constrained]}")


if __name__ == "__main__":
    main()
