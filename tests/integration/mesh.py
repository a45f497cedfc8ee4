"""Real meshnet processes on 127.0.0.1 for integration tests: the product's own launcher
(:class:`meshnet.localmesh.LocalMesh`: start, wait, stop by PID) plus a chat helper."""

from __future__ import annotations

import json
import contextlib
from pathlib import Path
from typing import Callable, Iterator

import httpx

from meshnet.endpoints import free_port  # noqa: F401 - re-exported for the tests
from meshnet.localmesh import LocalMesh

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


class Mesh(LocalMesh):
    """A :class:`LocalMesh` with the greedy chat the integration tests send."""

    def chat(self, model: str, messages: list[dict] | None = None, max_tokens: int = 16) -> httpx.Response:
        """A greedy chat completion through the tracker (default question: FRANCE)."""
        return httpx.post(f"{self.url}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": messages or FRANCE, "max_tokens": max_tokens, "temperature": 0})

    def stream_chat(self, model: str, messages: list[dict], max_tokens: int,
                    on_token: Callable[[int], None] | None = None) -> tuple[list[int], dict, list[str]]:
        """A greedy streamed chat through the tracker; ``on_token(n)`` is called at the n-th content
        chunk. Returns (completion token ids, the ``meshnet`` block, the raw ``data:`` payloads).

        Raises:
            AssertionError: a non-200 answer, an error event, or no closing ``meshnet`` block.
        """
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        final, count, lines = None, 0, []
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=600) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                lines.append(line[6:])
                if line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"][0]["delta"].get("content"):
                    count += 1
                    if on_token:
                        on_token(count)
                if chunk.get("meshnet"):
                    final = chunk["meshnet"]
        assert final is not None, lines[-3:]
        return final["completion_token_ids"], final, lines


@contextlib.contextmanager
def serving(log_dir: Path, model: str, ranges: list[tuple[int, int]], *node_args: str,
            wait_s: float = 240.0) -> Iterator[Mesh]:
    """A tracker and one node per inclusive layer range of ``model`` (``node-0``, ``node-1``, ...,
    each started with ``node_args``), routable before the block runs, stopped after it."""
    m = Mesh(log_dir)
    try:
        m.start_tracker(model)
        for i, (a, b) in enumerate(ranges):
            m.start_node(f"node-{i}", "--model", model, "--shard-start", str(a), "--shard-end", str(b), *node_args)
        m.wait_routable(model, wait_s)
        yield m
    finally:
        m.stop()


@contextlib.contextmanager
def three_hops(path: Path, model: str, *node_args: str, wait_s: float = 180.0) -> Iterator[Mesh]:
    """A tracker and three node processes of ``model`` over layers 0-9, 10-19 and 20-29 (``node-0``
    .. ``node-2``), float32 compute and wire, each also given ``node_args``; stopped by PID after."""
    m = Mesh(path)
    try:
        m.start_tracker(model)
        for i, (a, b) in enumerate([(0, 9), (10, 19), (20, 29)]):
            m.start_node(f"node-{i}", "--model", model, "--shard-start", str(a), "--shard-end", str(b),
                         "--dtype", "float32", "--wire-dtype", "float32", *node_args)
        m.wait_routable(model, wait_s)
        yield m
    finally:
        m.stop()
