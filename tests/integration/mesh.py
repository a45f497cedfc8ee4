"""Real meshnet processes on 127.0.0.1 for integration tests: the product's own launcher
(:class:`meshnet.localmesh.LocalMesh`: start, wait, stop by PID) plus a chat helper."""

from __future__ import annotations

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
