"""Paths as a mounted app routes them (meshnet.protocol.http.route_path): the tracker's own node is
mounted at /node (ADR-0044) and its body limits must hold there as at the root."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from meshnet.protocol.http import BodyLimit, route_path


@pytest.mark.parametrize("path, root, expected", [
    ("/v1/forward", "", "/v1/forward"),
    ("/node/v1/forward", "/node", "/v1/forward"),
    ("/node", "/node", "/"),
    ("/other/v1/forward", "/node", "/other/v1/forward"),  # not below the root: as it is
])
def test_route_path(path, root, expected):
    assert route_path({"path": path, "root_path": root}) == expected


def limited_app() -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    return Starlette(routes=[Route("/v1/forward", echo, methods=["POST"]), Route("/v1/json", echo, methods=["POST"])],
                     middleware=[Middleware(BodyLimit, max_bytes=10, path_limits={"/v1/forward": 100})])


@pytest.mark.parametrize("prefix", ["", "/node"])
async def test_a_mounted_app_keeps_its_path_limits(prefix):
    app = limited_app() if not prefix else Starlette(routes=[Mount(prefix, app=limited_app())])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.post(f"{prefix}/v1/forward", content=b"x" * 50)).json() == {"bytes": 50}
        too_big = await client.post(f"{prefix}/v1/json", content=b"x" * 50)
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"
