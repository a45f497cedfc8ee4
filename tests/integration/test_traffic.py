"""The traffic view's data from real processes and the real model (ADR-0046): while a chat streams
through the tracker, its ``GET /v1/traffic`` lists the session with its route; afterwards the
entry's buckets hold its time to first token and time per output token, and both nodes' buckets
its forward tokens and batch sizes."""

from __future__ import annotations

import time

import pytest

from meshnet.tracker.traffic import CACHE_S
from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Write a short story about a lighthouse."}]


@pytest.fixture(scope="module")
def mesh(real_model_path, tmp_path_factory):
    """Entry node 0-14 and node tail 15-29."""
    m = Mesh(tmp_path_factory.mktemp("traffic"))
    try:
        m.start_tracker(REAL)
        # one token per decode step: the test counts the tokens each node's layers ran (speculative steps
        # would add their rejected drafts; tests/integration/test_speculation_real.py covers those)
        m.start_node("entry", "--model", REAL, "--shard-start", "0", "--shard-end", "14", "--speculate", "off")
        m.start_node("tail", "--model", REAL, "--shard-start", "15", "--shard-end", "29")
        m.wait_routable(REAL, 240)
        yield m
    finally:
        m.stop()


def test_the_tracker_shows_a_streaming_session_then_its_ttft_tpot_and_batch_sizes(mesh):
    seen = []

    def on_token(count: int) -> None:
        if count == 4:
            seen.append(mesh.get("/v1/traffic"))

    def forward_tokens() -> dict[str, dict[float, int]]:  # node -> bucket start -> tokens its layers ran
        return {n["node_id"]: {b["start_s"]: b["forward_tokens"] for b in n["buckets"]}
                for n in mesh.get("/v1/traffic")["nodes"]}

    # the tracker's admission challenges ran 16 tokens through each node before (ADR-0070)
    before = forward_tokens()
    time.sleep(CACHE_S + 0.5)  # the tracker serves a gathered answer again for CACHE_S: the next one is fresh
    ids, final, _ = mesh.stream_chat(REAL, STORY, 24, on_token)
    assert len(ids) == 24 and seen
    [session] = seen[0]["sessions"]
    assert (session["model"], session["entry_node"], session["failovers"]) == (REAL, "entry", 0)
    assert [(h["node_id"], h["start_layer"], h["end_layer"]) for h in session["route"]] == \
        [("entry", 0, 14), ("tail", 15, 29)]
    assert session["completion_tokens"] >= 4 and session["ttft_s"] > 0
    after = mesh.wait(lambda: (t := mesh.get("/v1/traffic?buckets=6")) and not t["sessions"] and t, 10,
                      "the session to end")
    nodes = {n["node_id"]: n for n in after["nodes"]}
    assert set(nodes) == {"entry", "tail"} and all(n["error"] is None for n in nodes.values())
    entry, tail = nodes["entry"]["buckets"], nodes["tail"]["buckets"]
    assert sum(b["first_tokens"] for b in entry) == 1 and sum(b["finished"] for b in entry) == 1
    assert sum(b["first_tokens"] for b in tail) == 0  # only the entry sees tokens reach the client
    # prompt + 23 decode steps through each node's layers (the 24th token is never fed back)
    prompt = session["prompt_tokens"]
    ran = {node: sum(tokens - before.get(node, {}).get(start, 0) for start, tokens in buckets.items())
           for node, buckets in forward_tokens().items()}
    assert ran == {"entry": prompt + 23, "tail": prompt + 23}
    assert {b["batch_size_max"] for b in tail if b["forwards"]} == {1}
    assert after["failovers"] == []
