"""The tracker's chat proxy watches its client while the entry's answer has not begun, and never
times out reading a slow entry (ADR-0049)."""

from __future__ import annotations

import asyncio

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.tracker import proxy
from meshnet.tracker.tickets import TicketIssuer


class SlowEntry(httpx.AsyncBaseTransport):
    """An entry that answers after ``delay_s`` (or never, with None); records whether the
    request was cancelled while it waited, and the timeouts it was sent with."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s, self.cancelled, self.timeouts = delay_s, False, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.timeouts.append(request.extensions.get("timeout"))
        try:
            await asyncio.sleep(3600 if self.delay_s is None else self.delay_s)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return httpx.Response(200, json={"ok": True})


async def test_a_client_that_hangs_up_cancels_the_entrys_request():
    entry = SlowEntry(None)
    calls = []

    async def disconnected() -> bool:
        calls.append(1)
        return len(calls) >= 2

    async with httpx.AsyncClient(transport=entry) as http, asyncio.timeout(10):
        upstream = http.build_request("POST", "http://entry/v1/chat/completions", content=b"{}")
        assert await proxy.send_watching(http, upstream, disconnected) is None
    assert entry.cancelled and len(calls) == 2


async def test_an_entry_that_answers_while_the_client_waits_is_passed_on():
    entry = SlowEntry(0.6)

    async def disconnected() -> bool:
        return False

    async with httpx.AsyncClient(transport=entry) as http, asyncio.timeout(10):
        upstream = http.build_request("POST", "http://entry/v1/chat/completions", content=b"{}")
        resp = await proxy.send_watching(http, upstream, disconnected)
        assert resp.status_code == 200 and (await resp.aread()) == b'{"ok":true}'
        await resp.aclose()
    assert not entry.cancelled


async def test_a_proxied_chat_has_a_connect_timeout_and_no_read_timeout():
    from meshnet.tracker.registry import NodeRecord

    entry = SlowEntry(0.0)

    class Service:
        tickets = TicketIssuer(Ed25519PrivateKey.generate())

        def report_failure(self, node_id, reason):
            raise AssertionError(f"{node_id} reported: {reason}")

    node = NodeRecord.__new__(NodeRecord)
    node.node_id, node.endpoint = "n1", "http://entry"
    async with httpx.AsyncClient(transport=entry, timeout=httpx.Timeout(600.0, connect=5.0)) as http:
        resp = await proxy.forward_chat(Service(), http, [node], b"{}", lambda n: None)
        assert resp.status_code == 200
    assert entry.timeouts == [{"connect": proxy.CONNECT_TIMEOUT_S, "read": None, "write": None, "pool": None}]
