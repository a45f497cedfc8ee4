"""Fault-tolerant and concurrent generation with real processes and the real model."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


@pytest.fixture(scope="module")
def mesh(real_model_path, tmp_path_factory):
    """Entry node 0-9 plus two full copies of 10-19 and 20-29: two full routes."""
    m = Mesh(tmp_path_factory.mktemp("failover"))
    try:
        m.start_tracker(REAL, node_timeout_s=5.0)
        shards = {"entry": (0, 9), "mid-a": (10, 19), "mid-b": (10, 19), "tail-a": (20, 29), "tail-b": (20, 29)}
        for name, (a, b) in shards.items():
            m.start_node(name, "--model", REAL, "--shard-start", str(a), "--shard-end", str(b))
        m.wait(lambda: all(s["node_count"] == 2 for s in m.get(f"/v1/coverage/{REAL}")["segments"][1:]) and
               m.get(f"/v1/coverage/{REAL}")["routable"], 240, "two full routes")
        yield m
    finally:
        m.stop()


def generate(mesh, messages, max_tokens, on_token=None) -> tuple[list[int], dict]:
    body = {"model": REAL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    final, count = None, 0
    with httpx.stream("POST", f"{mesh.url}/v1/chat/completions", json=body, timeout=600) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"][0]["delta"].get("content"):
                count += 1
                if on_token:
                    on_token(count)
            if chunk.get("meshnet"):
                final = chunk["meshnet"]
    return final["completion_token_ids"], final


def active_middle(mesh) -> str:
    for name in ("mid-a", "mid-b"):
        node = next(n for n in mesh.get("/v1/nodes")["nodes"] if n["node_id"] == name)
        if httpx.get(f"{node['endpoint']}/v1/health", timeout=5).json()["sessions"] > 0:
            return name
    raise AssertionError("no middle node holds the session")


def test_eight_concurrent_chats_equal_their_solo_runs(mesh):
    prompts = [[{"role": "user", "content": f"Name {k} animals that live in the {place}."}]
               for k, place in zip(range(2, 10), ["sea", "desert", "forest", "arctic", "jungle", "sky", "river", "cave"])]
    solo = [generate(mesh, p, 16)[0] for p in prompts]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: generate(mesh, p, 16)[0], prompts))
    assert together == solo
    assert len({tuple(s) for s in solo}) > 1


def test_killing_the_middle_node_mid_generation_keeps_the_tokens(mesh):
    expected, _ = generate(mesh, STORY, 64)
    assert len(expected) == 64
    killed, stamps = [], {}

    def on_token(count):
        stamps[count] = time.monotonic()
        if count == 10 and not killed:
            name = active_middle(mesh)
            mesh.kill(name)  # SIGKILL, by PID
            killed.append((name, time.monotonic()))

    got, meta = generate(mesh, STORY, 64, on_token)
    assert killed, "the kill did not happen"
    assert got == expected
    assert meta["failovers"] >= 1
    assert killed[0][0] not in [h["node_id"] for h in meta["route"]]
    after = [t for t in stamps.values() if t > killed[0][1]]
    recovery_s = min(after) - killed[0][1] if after else 0.0
    print(f"time from kill to next token: {recovery_s:.2f} s")
    assert recovery_s < 30
