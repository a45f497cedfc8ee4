"""Paths as a mounted app routes them (meshnet.protocol.http.route_path): the tracker's own node is
mounted at /node (ADR-0044) and its body limits must hold there as at the root."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from meshnet.errors import MeshnetError
from meshnet.protocol.http import BodyLimit, error_response, route_path


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


async def call_trickling(app, chunks: list[bytes], pause_s: float) -> tuple[int, bytes]:
    """POST ``chunks`` to ``app`` one at a time, ``pause_s`` apart; ``(status, body)`` of the answer."""
    pending = list(chunks)
    sent: list[dict] = []

    async def receive() -> dict:
        if not pending:
            await asyncio.sleep(3600)  # the client says nothing more (a disconnect never comes)
        await asyncio.sleep(pause_s)
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/json", "raw_path": b"/v1/json", "root_path": "", "query_string": b"", "headers": [],
             "server": ("t", 80), "client": ("c", 1)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def test_a_body_that_trickles_in_past_its_deadline_is_a_408_and_one_in_time_is_read():
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    async def on_error(request: Request, exc: MeshnetError):
        return error_response(exc)

    app = Starlette(routes=[Route("/v1/json", echo, methods=["POST"])], exception_handlers={MeshnetError: on_error},
                    middleware=[Middleware(BodyLimit, max_bytes=1000, body_timeout_s=0.3)])
    status, body = await call_trickling(app, [b"x"] * 20, pause_s=0.05)  # 1 s in all
    assert status == 408 and b"request_timeout" in body and b"took over 0.3 s" in body
    status, body = await call_trickling(app, [b"x"] * 3, pause_s=0.05)
    assert (status, body) == (200, b'{"bytes":3}')
