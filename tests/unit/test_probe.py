"""Reachability probe (meshnet.tracker.probe): which answers make a node reachable."""

from __future__ import annotations

import httpx
import pytest

from meshnet.tracker.probe import probe_endpoint


def answering(status: int, body=None, raw: bytes | None = None):
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/health"
        if raw is not None:
            return httpx.Response(status, content=raw)
        return httpx.Response(status, json=body)
    return httpx.MockTransport(handler)


def refusing():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
    return httpx.MockTransport(handler)


@pytest.mark.parametrize("transport, verdict", [
    (answering(200, {"status": "ok", "node_id": "n1"}), ""),
    (answering(200, {"status": "ok"}), ""),                             # no id given: a 200 is enough
    (answering(503, {"status": "draining", "node_id": "n1"}), ""),      # the right node, busy: reachable
    (answering(503, {"error": {"code": "x"}}), "answered HTTP 503"),
    (answering(404, raw=b"not found"), "answered HTTP 404"),            # some other web server
    (answering(200, {"node_id": "n2"}), "answered as node 'n2', not 'n1'"),
    (refusing(), "failed: ConnectError: [Errno 111] Connection refused"),
])
async def test_probe_verdicts(transport, verdict):
    async with httpx.AsyncClient(transport=transport) as http:
        got = await probe_endpoint(http, "http://n1.test:8000", "n1", timeout_s=1.0)
    assert (got == "") if verdict == "" else (verdict in got and got.startswith("GET http://n1.test:8000/v1/health"))


async def test_an_unusable_url_is_unreachable_not_an_exception():
    async with httpx.AsyncClient() as http:
        got = await probe_endpoint(http, "http://::1:8821", "n1", timeout_s=1.0)
    assert "InvalidURL" in got
