"""The tracker's outbound transport in tests: fake nodes answer its reachability probes.

Service and console tests register fake nodes (``http://n1.test:8000``) that no server
listens on; the tracker admits a node's shards only once ``GET {endpoint}/v1/health``
answers. :class:`HealthyNodes` answers that probe for every host except those in ``down``
and passes any other request to ``inner`` (the real network by default), so a test that
runs a real node server still reaches it.
"""

from __future__ import annotations

import httpx


class HealthyNodes(httpx.AsyncBaseTransport):
    """``GET /v1/health`` is 200 ``{"status": "ok"}`` unless the host is in ``down`` (connection refused)."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.down: set[str] = set()
        self.probes: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host in self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.method == "GET" and request.url.path == "/v1/health":
            self.probes.append(str(request.url))
            return httpx.Response(200, json={"status": "ok"})
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()
