"""Audit benchmark (ADR-0067): what signed steps and decode audits cost, and how fast they catch a liar.

Real processes, SmolLM2-135M, bfloat16, a 3-hop route: an entry 0-9, holders of the middle range
10-19, one holder of 20-29. Load averages are printed before each part (this machine is shared).

Part 1, cost and false positives: two entries, ``entry-on`` at the default audit settings and
``entry-off`` with audits off (the node's ``--audit-rate 0``: no receipts asked, none audited; this
bench's ``--audit-rate R`` gives ``entry-on`` rate R, 1 to audit every session for the false-positive
count), three honest
holders of 10-19 on different weight layouts and thread counts (:data:`LAYOUTS`; where this CPU
cannot pack bfloat16, :func:`layouts` runs the row layout with 2 threads in its place). ``--requests`` greedy chats per entry, interleaved, in three rounds; prints each
round's median decode tokens/s with and without audits and their ratio (the median of the three
ratios is the figure), and what the audits found: audits run, passed, disputes (on honest holders
every dispute is a false positive), quarantines, and the quantiles of the largest step distance
of each audit.

Part 2, sensitivity: per noise scale (``--scales``), a mesh whose third middle holder lies on every
decode step (``tests/corrupt.py``, test-only): with ``--noise weights`` (the default) it runs its
decode steps with noise of scale x the weight's std on layer 15's MLP down-projection, and every
other step honestly; with ``--noise output`` it adds noise of scale x its output's std; with
``--noise streams`` it runs every step that comes over a hop stream (prefill and decode) with the
weight noise and answers ``POST /v1/forward`` (challenges, witness replays) honestly. It claims
ten times its speed, so that routes take it; ``--cycles`` times: chats until it is quarantined
(at most 60 requests), counting the requests routed through it, then the operator reinstates it
(a scale that three cycles in a row do not catch ends there). With ``--noise replays`` the liar
frames instead: it computes honestly everywhere but in the witness replays of an entry's audits
(weight noise there), claiming five times its speed, behind an honest ``fast`` holder claiming ten:
sessions go through ``fast`` and the liar witnesses its audits; every request counts, and the
entry must never be the one quarantined.
With ``--withhold`` the liar also answers every transcript request 404 (its audits run on the
frames its receipts name, which the entry and the tail kept). Prints the counts, their median and
how many cycles caught it within 50 requests. The entry
never sees the liar pass an audit, so it stays on probation (rate 0.5); a holder that lied only
after passing five audits is audited at the base rate r = 0.06 and is caught within 50 requests
with probability 1 - (1 - r)**50 = 0.955 when each audit catches it.

Usage: .venv/bin/python bench/audits.py [--requests 60] [--cycles 20] [--scales 0.5,0.2,0.1,0.05] [--max-tokens 12]
[--noise weights|output|streams|replays] [--withhold]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.spotcheck import BF16, MODEL, PROMPTS  # noqa: E402 - the spot-check bench's prompts and recipe
MIDDLE = ("--model", MODEL, "--shard-start", "10", "--shard-end", "19", *BF16)
#: the honest holders of part 1: weight layouts and torch threads that differ, as across hosts
LAYOUTS = (("h1", "row", 1), ("h2", "packed", 1), ("h3", "transposed", 2))


def layouts() -> tuple[tuple[str, str, int], ...]:
    """:data:`LAYOUTS` as this CPU can run them: where it cannot pack bfloat16 weights (a node asked
    for ``packed`` then refuses to start), ``h2`` runs the row layout with 2 threads instead."""
    import torch

    from meshnet.models.linears import available_layouts

    usable = available_layouts(torch.bfloat16)
    return tuple((name, layout, threads) if layout in usable else (name, "row", 2) for name, layout, threads in LAYOUTS)


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return f"n={len(values)} min {min(values):.4f} p50 {q[49]:.4f} p99 {q[98]:.4f} max {max(values):.4f}"


def nodes(mesh) -> dict[str, dict]:
    return {n["node_id"]: n for n in mesh.get("/v1/nodes")["nodes"]}


def admitted(mesh, names: tuple[str, ...]) -> bool:
    view = nodes(mesh)
    return all(name in view and view[name]["shards"] and all(s["admitted"] for s in view[name]["shards"])
               for name in names)


def chat(endpoint: str, i: int, max_tokens: int) -> dict:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
    resp = httpx.post(f"{endpoint}/v1/chat/completions", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()["meshnet"]


def cost(requests: int, max_tokens: int, audit_rate: str | None = None) -> None:
    from meshnet.localmesh import LocalMesh

    print(f"part 1: cost and false positives ({load()})")
    with tempfile.TemporaryDirectory() as tmp:
        mesh = LocalMesh(Path(tmp), heartbeat_s=1.0)
        try:
            mesh.start_tracker(MODEL, node_timeout_s=10.0)
            for name, rate in (("entry-on", audit_rate), ("entry-off", "0")):
                mesh.start_node(name, "--model", MODEL, "--shard-start", "0", "--shard-end", "9", *BF16,
                                env={} if rate is None else {"MESHNET_AUDIT_RATE": rate})
            mesh.start_node("tail", "--model", MODEL, "--shard-start", "20", "--shard-end", "29", *BF16)
            holders = layouts()
            print("  holders of 10-19 (name, weight layout, threads): "
                  + ", ".join(f"{n} {layout} {t}" for n, layout, t in holders))
            for name, layout, threads in holders:
                mesh.start_node(name, *MIDDLE, threads=threads, env={"MESHNET_WEIGHT_LAYOUT": layout})
            names = ("entry-on", "entry-off", "tail", *(name for name, _, _ in holders))
            mesh.wait(lambda: admitted(mesh, names), 300, "every node admitted")
            entries = {n: nodes(mesh)[n]["endpoint"] for n in ("entry-on", "entry-off")}
            ratios = []
            for round_ in range(3):
                tps = {"entry-on": [], "entry-off": []}
                for i in range(requests // 3):
                    for name in ("entry-on", "entry-off") if i % 2 == 0 else ("entry-off", "entry-on"):
                        tps[name].append(chat(entries[name], i, max_tokens)["decode_tokens_per_s"])
                on, off = statistics.median(tps["entry-on"]), statistics.median(tps["entry-off"])
                ratios.append(on / off)
                print(f"  round {round_ + 1}: decode tokens/s median with audits {on:.2f}, without {off:.2f}, "
                      f"ratio {on / off:.3f} ({load()})")
            time.sleep(3.0)  # the last audits finish
            audits = httpx.get(f"{entries['entry-on']}/v1/health", timeout=5).json()["audits"]
            quarantined = [n for n, v in nodes(mesh).items() if v.get("quarantine")]
            print(f"  decode tokens/s with audits over without, median of 3 rounds: {statistics.median(ratios):.3f}")
            print(f"  audits of hops {audits['audits']}: passed {audits['passed']}, disputes {audits['disputes']} "
                  f"(false positives: all holders are honest), withheld {audits['withheld']}, mismatched "
                  f"{audits['mismatched']}, no witness {audits['unverified']}; quarantined {quarantined or 'none'}")
            print(f"  largest step distance per audit (the latest 100): {quantiles(audits['distances'])}")
        finally:
            mesh.stop()


def sensitivity(scale: float, cycles: int, max_tokens: int, noise: str, keep_logs: str | None = None,
                withhold: bool = False) -> None:
    from meshnet.localmesh import LocalMesh

    what = "its output's std" if noise == "output" else "layer 15's MLP down-projection weight std"
    where = {"streams": "every hop-stream step", "replays": "the witness replays of entries' audits"}.get(
        noise, "decode steps")
    print(f"part 2: a holder lying on {where} by {scale} x {what} ({load()})")
    lie = ({"MESHNET_TEST_CORRUPT_DECODE": str(scale)} if noise == "output" else
           {"MESHNET_TEST_CORRUPT_STREAMS_WEIGHTS": str(scale), "MESHNET_TEST_CORRUPT_LAYER": "15"}
           if noise == "streams" else
           {"MESHNET_TEST_CORRUPT_REPLAYS_WEIGHTS": str(scale), "MESHNET_TEST_CORRUPT_LAYER": "15"}
           if noise == "replays" else
           {"MESHNET_TEST_CORRUPT_DECODE_WEIGHTS": str(scale), "MESHNET_TEST_CORRUPT_LAYER": "15"})
    framing = noise == "replays"
    if withhold:  # and it keeps no transcript: its audits run on the frames its neighbours kept
        lie["MESHNET_TEST_WITHHOLD_TRANSCRIPTS"] = "1"
        print("  the liar answers every transcript request 404")
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(keep_logs) / f"{noise}-{scale}" if keep_logs else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        mesh = LocalMesh(logs, heartbeat_s=1.0)
        try:
            # routes are steered by claimed speeds (test-only): the tracker's speed probes (ADR-0068) are off
            mesh.start_tracker(MODEL, node_timeout_s=10.0, extra=["--speed-probe-interval", "0"])
            mesh.start_node("entry", "--model", MODEL, "--shard-start", "0", "--shard-end", "9", *BF16)
            mesh.start_node("tail", "--model", MODEL, "--shard-start", "20", "--shard-end", "29", *BF16)
            mesh.start_node("h1", *MIDDLE)
            mesh.start_node("h2", *MIDDLE)
            if framing:  # the holder sessions go through; the liar witnesses its audits
                mesh.start_node("fast", *MIDDLE, module="tests.corrupt", env={"MESHNET_TEST_CLAIM_SPEED": "10"})
            mesh.wait(lambda: admitted(mesh, ("entry", "tail", "h1", "h2", *(("fast",) if framing else ()))), 300,
                      "honest nodes admitted")
            mesh.start_node("liar", *MIDDLE, module="tests.corrupt",
                            env={**lie, "MESHNET_TEST_CLAIM_SPEED": "5" if framing else "10"})
            mesh.wait(lambda: admitted(mesh, ("liar",)), 300, "the liar admitted")
            entry = nodes(mesh)["entry"]["endpoint"]
            counts, missed, i = [], [], 0
            for _ in range(cycles):
                through = None
                for _ in range(60):
                    route = [h["node_id"] for h in chat(entry, i, max_tokens)["route"]]
                    i += 1
                    through = (through or 0) + (framing or "liar" in route)
                    deadline = time.monotonic() + (3.0 if framing or "liar" in route else 0.0)
                    while not nodes(mesh)["liar"].get("quarantine") and time.monotonic() < deadline:
                        time.sleep(0.2)  # the audit runs after its session
                    if nodes(mesh)["liar"].get("quarantine") or nodes(mesh)["entry"].get("quarantine"):
                        break
                caught = bool(nodes(mesh)["liar"].get("quarantine"))
                counts.append(through if caught else None)
                if not caught:
                    missed.append(through)
                if counts[-3:] == [None] * 3:  # below what an audit can tell from honest rounding
                    break
                if nodes(mesh)["entry"].get("quarantine"):
                    print(f"  the entry was quarantined: {nodes(mesh)['entry']['quarantine']}")
                    break
                if caught:
                    httpx.post(f"{mesh.url}/v1/operator/reinstate", json={"node_id": "liar"}, timeout=10)
                    mesh.wait(lambda: admitted(mesh, ("liar",)) and not nodes(mesh)["liar"].get("quarantine"), 120,
                              "the liar reinstated")
            got = [c for c in counts if c is not None]
            within = sum(1 for c in got if c <= 50)
            wrong = {n: v["quarantine"] for n, v in nodes(mesh).items() if v.get("quarantine") and n != "liar"}
            audits = httpx.get(f"{entry}/v1/health", timeout=5).json()["audits"]
            print(f"  requests {'' if framing else 'through it '}until quarantined, per cycle: {counts}"
                  f"{f' (None: not caught in 60 requests, {missed} of them through it)' if missed else ''}")
            verdicts = collections.Counter(v.get("verdict") for v in audits["verdicts"])
            print(f"  the entry's audits: {audits['audits']} run, {audits['passed']} passed, {audits['disputes']} "
                  f"disputed; the tracker's verdicts on them: {dict(verdicts)}; largest step distance per audit: "
                  f"{quantiles([d for d in audits['distances'] if d > 0])} (0.0 left out: honest holders, one layout)")
            print(f"  median {statistics.median(got) if got else 'never'}; caught within 50 in {within} of {cycles} "
                  f"cycles; honest nodes quarantined: {wrong or 'none'}; the entry's accusations: "
                  f"{nodes(mesh)['entry'].get('accusations')}")
        finally:
            mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="chats per entry in part 1 (three rounds)")
    parser.add_argument("--cycles", type=int, default=20, help="quarantine-and-reinstate cycles per scale")
    parser.add_argument("--scales", default="0.5,0.2,0.1,0.05", help="noise scales of part 2 (x the std)")
    parser.add_argument("--noise", choices=("weights", "output", "streams", "replays"), default="weights",
                        help="part 2's lie: noise on layer 15's MLP weights during decode steps, or on the "
                             "decode output, or on layer 15's MLP weights for every hop-stream step, or for "
                             "the witness replays of entries' audits (a witness framing honest holders)")
    parser.add_argument("--withhold", action="store_true",
                        help="part 2's liar also keeps no transcript (its audits rebuild it from its neighbours')")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--keep-logs", metavar="DIR", help="keep part 2's process logs under DIR/<noise>-<scale>")
    parser.add_argument("--audit-rate", help="part 1's entry-on audit rate (default: the entry's default); 1 audits "
                                             "every session, for the false-positive count")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-sensitivity", action="store_true")
    args = parser.parse_args()
    if not args.skip_cost:
        cost(args.requests, args.max_tokens, args.audit_rate)
    if not args.skip_sensitivity:
        for scale in (float(s) for s in args.scales.split(",")):
            sensitivity(scale, args.cycles, args.max_tokens, args.noise, args.keep_logs, args.withhold)


if __name__ == "__main__":
    main()
