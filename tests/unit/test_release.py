"""Releases of a session's hops (meshnet.dataplane.failover): a broken connection is not the end."""

from __future__ import annotations

import asyncio

import httpx

from meshnet.dataplane import failover as remote


def flaky(first: Exception | None):
    """A transport whose first DELETE fails with ``first`` (None: answers), the rest answer 200."""
    calls: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if first is not None and len(calls) == 1:
            raise first
        return httpx.Response(200, json={"released": 1})

    return httpx.MockTransport(handle), calls


async def test_a_release_whose_connection_broke_is_sent_again_on_a_fresh_one(monkeypatch):
    """A frozen node's keep-alive connection may be reset before it answers (seen with a SIGSTOPped
    hop): the release goes again and waits in the fresh connection's socket until it resumes."""
    monkeypatch.setattr(remote, "RELEASE_RETRY_S", 0.01)
    transport, calls = flaky(httpx.ReadError("connection reset"))
    async with httpx.AsyncClient(transport=transport) as client, asyncio.timeout(10):
        remote.release_soon(client, [("http://frozen", None)], "ab" * 16, timeout_s=5.0)
        await remote.settle_releases(5.0)
    assert calls == [f"/v1/sessions/{'ab' * 16}"] * 2


async def test_a_refused_release_is_not_sent_again():
    """Nobody listens (the node died with its sessions): one try, then the hop's TTL does the rest."""
    transport, calls = flaky(httpx.ConnectError("refused"))
    async with httpx.AsyncClient(transport=transport) as client, asyncio.timeout(10):
        remote.release_soon(client, [("http://dead", None)], "cd" * 16, timeout_s=5.0)
        await remote.settle_releases(5.0)
    assert len(calls) == 1
