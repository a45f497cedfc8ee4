"""Chains of hop streams with real processes and the real model, float32 (ADR-0040).

The entry node (layers 0-9) drives every generation as a chain: it pushes each step to the
middle node (10-19), which pushes to the tail (20-29), which returns the result straight to
the entry. Two middles serve 10-19, so a middle that dies or freezes is replaced.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
#: float32 compute and wire; no spot-checks (a checked session runs hop by hop over HTTP, ADR-0042)
FLOAT32 = ("--dtype", "float32", "--wire-dtype", "float32", "--spot-check-rate", "0")
HIDDEN = 576


def start_middle(mesh: Mesh, name: str) -> None:
    mesh.start_node(name, "--model", REAL, "--shard-start", "10", "--shard-end", "19", *FLOAT32)


def middles_up(mesh: Mesh) -> None:
    """Wait until the tracker routes layers 10-29 through each running middle alone (every other
    middle it knows excluded, a dead one it has not dropped yet included): whichever holds the
    session, another can take it over (counted in coverage is not enough: admission may lag)."""
    names = [n for n in mesh.procs if n.startswith("mid-")]

    def each_replaceable() -> bool:
        known = {n["node_id"] for n in mesh.get("/v1/nodes")["nodes"] if n["node_id"].startswith("mid-")}
        return all(httpx.get(f"{mesh.url}/v1/route", timeout=5, params={
            "model": REAL, "start_layer": 10, "end_layer": 29,
            "exclude": ",".join(sorted(known - {name}))}).status_code == 200 for name in names)

    mesh.wait(each_replaceable, 240, f"a route without each of {names}", interval_s=0.5)


@pytest.fixture(scope="module")
def mesh(real_model_path, tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("chain"))
    try:
        # tests find the node holding a chat by its session count: no speed probes' sessions (ADR-0068)
        m.start_tracker(REAL, extra=["--speed-probe-interval", "0"], node_timeout_s=5.0)
        # one token per decode step: the tests here count a decode step's bytes and freeze a hop at a step
        # (speculative steps through a chain: tests/integration/test_failover.py, test_speculation_real.py)
        m.start_node("entry", "--model", REAL, "--shard-start", "0", "--shard-end", "9", *FLOAT32,
                     "--speculate", "off")
        m.start_node("tail", "--model", REAL, "--shard-start", "20", "--shard-end", "29", *FLOAT32)
        for name in ("mid-a", "mid-b"):
            start_middle(m, name)
        middles_up(m)
        m.wait_routable(REAL, 240)  # the entry's shard admitted too
        yield m
    finally:
        m.stop()


def endpoint(mesh: Mesh, name: str) -> str:
    return next(n for n in mesh.get("/v1/nodes")["nodes"] if n["node_id"] == name)["endpoint"]


def sessions(mesh: Mesh, name: str) -> int:
    return httpx.get(f"{node_url(mesh, name)}/v1/health", timeout=5).json()["sessions"]


def node_url(mesh: Mesh, name: str) -> str:
    """Node ``name``'s endpoint, from the line it logs when it starts listening."""
    match = re.search(r"listening on (\S+)", (mesh.log_dir / f"{name}.log").read_text(errors="replace"))
    assert match, f"{name} has not logged its endpoint"
    return match.group(1)


def holding_middle(mesh: Mesh) -> str:
    """The middle node that holds the session now (asked directly; one the tracker has dropped
    for a late heartbeat on this loaded machine is still asked)."""
    for name in sorted(n for n in mesh.procs if n.startswith("mid-")):
        if httpx.get(f"{node_url(mesh, name)}/v1/health", timeout=5).json()["sessions"] > 0:
            return name
    raise AssertionError("no middle node holds the session")


def stream_bytes_in(mesh: Mesh, name: str) -> float:
    text = httpx.get(f"{endpoint(mesh, name)}/metrics", timeout=5).text
    match = re.search(r'^meshnet_stream_bytes_total\{direction="in"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def generate(mesh: Mesh, max_tokens: int, on_token=None) -> tuple[list[int], dict]:
    ids, final, _ = mesh.stream_chat(REAL, STORY, max_tokens, on_token)
    return ids, final


def test_a_three_hop_chain_gives_transformers_greedy_tokens_over_streams(mesh, real_model_path):
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    before = stream_bytes_in(mesh, "tail")
    got, meta = generate(mesh, 32)
    tok = AutoTokenizer.from_pretrained(real_model_path)
    model = whole_model(real_model_path)
    ids = tok.apply_chat_template(STORY, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    expected = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(got) == 32 and got == expected
    assert [h["start_layer"] for h in meta["route"]] == [0, 10, 20] and meta["failovers"] == 0
    assert stream_bytes_in(mesh, "tail") > before  # the steps reached the tail over its stream
    # bytes into the tail per decode token: 32-byte stream header + 20-byte frame header + float32 hidden
    short_before = stream_bytes_in(mesh, "tail")
    generate(mesh, 8)
    short = stream_bytes_in(mesh, "tail") - short_before
    long_before = stream_bytes_in(mesh, "tail")
    generate(mesh, 40)
    per_token = (stream_bytes_in(mesh, "tail") - long_before - short) / 32
    print(f"bytes into the tail per decode token (float32 frames): {per_token:.0f}")
    assert abs(per_token - (4 * HIDDEN + 52)) < 1  # the OPENs of the two runs may differ by a digit or two


@pytest.mark.parametrize("n", [1, 4])
def test_a_client_that_disconnects_mid_stream_leaves_no_session_on_any_hop(mesh, n):
    body = {"model": REAL, "messages": STORY, "max_tokens": 400, "temperature": 0.7, "seed": 3, "stream": True, "n": n}
    count = 0
    with httpx.stream("POST", f"{mesh.url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                count += 1
                if count == 5:
                    break
    gone = time.monotonic()
    names = ["entry", "tail"] + sorted(name for name in mesh.procs if name.startswith("mid-"))
    mesh.wait(lambda: all(sessions(mesh, name) == 0 for name in names), 2.0, "every hop at 0 sessions",
              interval_s=0.05)
    print(f"n={n}: every hop at 0 sessions {time.monotonic() - gone:.2f} s after the client left")


def test_freezing_the_middle_node_costs_under_two_seconds_and_keeps_the_tokens(mesh):
    if sum(1 for n in mesh.procs if n.startswith("mid-")) < 2:
        start_middle(mesh, "mid-c")
    middles_up(mesh)
    expected, _ = generate(mesh, 64)
    stopped, stamps = [], {}

    def on_token(count):
        stamps[count] = time.monotonic()
        if count == 10 and not stopped:
            name = holding_middle(mesh)
            mesh.signal(name, signal.SIGSTOP)
            stopped.append(name)

    try:
        got, meta = generate(mesh, 64, on_token)
        assert stopped, "the stop did not happen"
        times = [stamps[k] for k in sorted(stamps)]
        stall_s = max(b - a for a, b in zip(times[9:], times[10:]))
        print(f"SIGSTOP of {stopped[0]}: longest gap between tokens after it {stall_s:.2f} s, "
              f"deadline misses {meta['deadline_misses']}, failovers {meta['failovers']}")
        assert got == expected
        assert (meta["failovers"], meta["deadline_misses"]) == (1, 1)  # one frozen hop: one chain replaced
        assert stopped[0] not in [h["node_id"] for h in meta["route"]]
        assert stall_s < 2.0
        mesh.signal(stopped[0], signal.SIGCONT)  # its release waited in the socket: the session goes at once
        mesh.wait(lambda: sessions(mesh, stopped[0]) == 0, 30, f"{stopped[0]} releases the session after SIGCONT")
    finally:
        for name in stopped:
            if name in mesh.procs:
                mesh.signal(name, signal.SIGCONT)
                mesh.kill(name)  # by PID


def test_killing_the_middle_node_keeps_the_tokens(mesh):
    if sum(1 for n in mesh.procs if n.startswith("mid-")) < 2:
        start_middle(mesh, "mid-d")
    middles_up(mesh)
    expected, _ = generate(mesh, 64)
    killed, stamps = [], {}

    def on_token(count):
        stamps[count] = time.monotonic()
        if count == 10 and not killed:
            name = holding_middle(mesh)
            mesh.kill(name)  # SIGKILL, by PID
            killed.append(name)

    got, meta = generate(mesh, 64, on_token)
    assert killed, "the kill did not happen"
    times = [stamps[k] for k in sorted(stamps)]
    stall_s = max(b - a for a, b in zip(times[9:], times[10:]))
    print(f"SIGKILL of {killed[0]}: longest gap between tokens after it {stall_s:.2f} s")
    assert got == expected
    assert meta["failovers"] == 1  # one killed hop: one chain replaced
    assert killed[0] not in [h["node_id"] for h in meta["route"]]
