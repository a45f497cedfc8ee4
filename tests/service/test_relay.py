"""The relay hub and the node's tunnel, in one process: a relay app and a stand-in node app served by
uvicorn on 127.0.0.1 (free ports), a real :class:`NodeTunnel` between them, and callers that reach the
node only as ``{relay}/v1/relay/{node_id}/...`` (ADR-0045)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from meshnet.endpoints import free_port
from meshnet.protocol.signing import sign_request
from meshnet.relay.backoff import Backoff
from meshnet.relay.auth import KeyedAuthorize
from meshnet.relay.hub import RelayHub, attach_target
from meshnet.relay.tunnel import NodeTunnel
from tests.payloads import node_key, public_key

NODE = "n-relayed"


# ---- a stand-in node: what its listener answers -----------------------------------------

async def echo(request: Request) -> Response:
    body = await request.body()
    return Response(body[::-1], headers={"X-Seen-Query": request.url.query,
                                         "X-Seen-Session": request.headers.get("x-meshnet-session", "")},
                    media_type="application/octet-stream")


async def sse(request: Request) -> StreamingResponse:
    async def events():
        for i in range(3):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.01)
    return StreamingResponse(events(), media_type="text/event-stream")


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"node_id": NODE, "status": "ok"})


async def release(request: Request) -> JSONResponse:
    return JSONResponse({"released": request.path_params["sid"]})


async def ws_echo(ws: WebSocket) -> None:
    await ws.accept(subprotocol="meshnet-test")
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("bytes") is not None:
            await ws.send_bytes(message["bytes"] * 2)
        else:
            if message["text"] == "bye":
                await ws.close(code=4001)
                return
            await ws.send_text(message["text"].upper())


NODE_APP = Starlette(routes=[Route("/v1/forward", echo, methods=["POST"]), Route("/v1/sse", sse),
                             Route("/v1/health", health),
                             Route("/v1/sessions/{sid}", release, methods=["DELETE"]),
                             WebSocketRoute("/v1/stream", ws_echo)])


# ---- servers ------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def serving(app, lifespan: str = "off"):
    """``app`` under uvicorn on 127.0.0.1:<free port> in this event loop; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan))
    task = asyncio.create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.025)
    assert server.started, "uvicorn did not start within 5 s"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)


def relay_app(max_body_bytes: int = 1 << 20, events: list | None = None) -> tuple[Starlette, RelayHub]:
    async def key_of(node_id: str) -> str | None:
        return public_key(node_id) if node_id.startswith("n-") else None

    seen = events if events is not None else []
    hub = RelayHub(KeyedAuthorize(key_of), max_body_bytes=max_body_bytes,
                   on_attach=lambda n: seen.append(("attach", n)), on_detach=lambda n: seen.append(("detach", n)))
    return Starlette(routes=hub.routes()), hub


@contextlib.asynccontextmanager
async def relayed_node(max_body_bytes: int = 1 << 20, events: list | None = None):
    """Yields ``(relayed endpoint, tunnel, hub)`` with the tunnel attached."""
    app, hub = relay_app(max_body_bytes, events)
    async with serving(NODE_APP) as local, serving(app) as relay:
        tunnel = NodeTunnel(relay, NODE, node_key(NODE), local, backoff=Backoff(0.05, 0.2))
        task = asyncio.create_task(tunnel.run())
        try:
            await asyncio.wait_for(tunnel.attached.wait(), timeout=10)
            yield tunnel.endpoint, tunnel, hub
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# ---- the tests ----------------------------------------------------------------------------

async def test_http_request_reaches_the_node_through_its_tunnel():
    async with relayed_node() as (endpoint, _, _), httpx.AsyncClient(timeout=10) as http:
        body = bytes(range(256)) * 2048  # 512 KiB: more than one DATA frame each way
        resp = await http.post(f"{endpoint}/v1/forward?x=1", content=body, headers={"X-Meshnet-Session": "s1"})
        assert resp.status_code == 200
        assert resp.content == body[::-1]
        assert resp.headers["x-seen-query"] == "x=1"
        assert resp.headers["x-seen-session"] == "s1"
        assert endpoint.endswith(f"/v1/relay/{NODE}")
        health = await http.get(f"{endpoint}/v1/health")
        assert health.json() == {"node_id": NODE, "status": "ok"}
        released = await http.delete(f"{endpoint}/v1/sessions/abc")
        assert released.json() == {"released": "abc"}


async def test_streamed_answer_passes_through_chunk_by_chunk():
    async with relayed_node() as (endpoint, _, _), httpx.AsyncClient(timeout=10) as http:
        async with http.stream("GET", f"{endpoint}/v1/sse") as resp:
            lines = [line async for line in resp.aiter_lines() if line]
        assert lines == ["data: 0", "data: 1", "data: 2"]


async def test_websocket_passes_through_both_ways():
    async with relayed_node() as (endpoint, _, _):
        url = endpoint.replace("http://", "ws://") + "/v1/stream"
        async with connect(url, subprotocols=["meshnet-test"], proxy=None) as ws:
            assert ws.subprotocol == "meshnet-test"
            await ws.send("hello")
            assert await asyncio.wait_for(ws.recv(), 5) == "HELLO"
            await ws.send(b"\x01\x02")
            assert await asyncio.wait_for(ws.recv(), 5) == b"\x01\x02\x01\x02"
            await ws.send("bye")
            with pytest.raises(Exception):
                await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_code == 4001


async def test_unknown_node_is_404_and_a_detached_one_503():
    events: list = []
    async with relayed_node(events=events) as (endpoint, tunnel, hub), httpx.AsyncClient(timeout=10) as http:
        relay = endpoint.split("/v1/relay/")[0]
        resp = await http.get(f"{relay}/v1/relay/n-nobody/v1/health")
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "relay_unknown_node"
        assert "n-nobody" in resp.json()["error"]["message"]
        await hub.tunnels[NODE].ws.close()  # the relay drops the tunnel: the node dials again by itself
        for _ in range(100):
            if ("detach", NODE) in events:
                break
            await asyncio.sleep(0.02)
        assert ("detach", NODE) in events
        down = await http.get(f"{endpoint}/v1/health")
        if down.status_code == 503:  # unless the node already came back
            assert down.json()["error"]["code"] == "relay_node_detached"
            assert down.headers["retry-after"] == "2"
        for _ in range(250):  # back-off of at most 0.2 s here: back within seconds
            if tunnel.attaches >= 2 and tunnel.attached.is_set():
                break
            await asyncio.sleep(0.02)
        assert tunnel.attaches == 2
        assert (await http.get(f"{endpoint}/v1/health")).status_code == 200
        assert events == [("attach", NODE), ("detach", NODE), ("attach", NODE)]


async def test_body_over_the_limit_is_413():
    async with relayed_node(max_body_bytes=1000) as (endpoint, _, _), httpx.AsyncClient(timeout=10) as http:
        resp = await http.post(f"{endpoint}/v1/forward", content=b"x" * 1001)
        assert resp.status_code == 413
        assert resp.json()["error"]["code"] == "payload_too_large"
        ok = await http.post(f"{endpoint}/v1/forward", content=b"x" * 1000)
        assert ok.status_code == 200


async def test_only_the_node_itself_may_attach():
    app, hub = relay_app()
    async with serving(app) as relay:
        url = relay.replace("http://", "ws://") + f"/v1/tunnel/{NODE}"
        here = attach_target(relay.removeprefix("http://"), f"/v1/tunnel/{NODE}")  # 127.0.0.1:PORT
        cases = {
            "unsigned": {},
            "another node's signature": sign_request(node_key("n-other"), "n-other", "GET", here, b""),
            "signed with another key": sign_request(node_key(NODE, salt="thief"), NODE, "GET", here, b""),
            "signed for another path": sign_request(node_key(NODE), NODE, "GET",
                                                    attach_target(relay.removeprefix("http://"), "/v1/tunnel/n-other"),
                                                    b""),
            "signed for another relay": sign_request(node_key(NODE), NODE, "GET",
                                                     attach_target("relay.example:8700", f"/v1/tunnel/{NODE}"), b""),
            "signed without the relay (revision 4)": sign_request(node_key(NODE), NODE, "GET", f"/v1/tunnel/{NODE}",
                                                                  b""),
        }
        statuses = {}
        for name, headers in cases.items():
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url, additional_headers=headers, proxy=None):
                    pass
            statuses[name] = (refused.value.response.status_code,
                              json.loads(refused.value.response.body)["error"]["code"])
        assert statuses == {"unsigned": (401, "unsigned"), "another node's signature": (403, "not_your_node"),
                            "signed with another key": (401, "bad_signature"),
                            "signed for another path": (401, "bad_signature"),
                            "signed for another relay": (401, "bad_signature"),
                            "signed without the relay (revision 4)": (401, "bad_signature")}
        good = sign_request(node_key(NODE), NODE, "GET", here, b"")
        async with connect(url, additional_headers=good, proxy=None):
            for _ in range(100):
                if NODE in hub.tunnels:
                    break
                await asyncio.sleep(0.02)
            assert NODE in hub.tunnels
        with pytest.raises(InvalidStatus) as replayed:  # the same signed headers again
            async with connect(url, additional_headers=good, proxy=None):
                pass
        assert replayed.value.response.status_code == 401


async def test_a_node_offering_relay_carries_another_nodes_traffic():
    """``--offer-relay``: the node app mounts a hub that checks attaches against the tracker's key binding."""
    from types import SimpleNamespace

    from meshnet.node.app import build_app
    from meshnet.node.settings import NodeSettings

    asked = []

    async def node_key_of(node_id: str) -> str | None:
        asked.append(node_id)
        return public_key(node_id) if node_id == NODE else None

    relay_node = build_app(NodeSettings(node_id="n-relay", port=1, tracker_url="http://tracker.invalid",
                                        offer_relay=True), start_agent=False)
    async with serving(NODE_APP) as local, serving(relay_node, lifespan="on") as relay, \
            httpx.AsyncClient(timeout=10) as http:
        relay_node.state.node.agent = SimpleNamespace(client=SimpleNamespace(node_key=node_key_of), endpoint=None,
                                                       signer=None, tunnel=None)
        tunnel = NodeTunnel(relay, NODE, node_key(NODE), local, backoff=Backoff(0.05, 0.2))
        task = asyncio.create_task(tunnel.run())
        try:
            await asyncio.wait_for(tunnel.attached.wait(), timeout=10)
            resp = await http.post(f"{relay}/v1/relay/{NODE}/v1/forward", content=b"abc")
            assert resp.content == b"cba"
            assert asked == [NODE]
            stranger = NodeTunnel(relay, "n-stranger", node_key("n-stranger"), local, backoff=Backoff(5, 5))
            stranger_task = asyncio.create_task(stranger.run())
            for _ in range(100):
                if stranger.last_error:
                    break
                await asyncio.sleep(0.02)
            stranger_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stranger_task
            assert "HTTP 404" in stranger.last_error and "unknown_node" in stranger.last_error
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
