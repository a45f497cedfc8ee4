"""The relay side of the tunnel (ADR-0045): tunnels by node id, and the routes that expose them.

A node that cannot be reached attaches one WebSocket at ``/v1/tunnel/{node_id}``, signed with
its key (ADR-0035). The relay then exposes it as ``{relay}/v1/relay/{node_id}``: every HTTP
request under that prefix (``POST /v1/forward``, ``DELETE /v1/sessions/...``, health, chat, ...)
and every WebSocket connection under it travels over the node's tunnel as one channel
(:mod:`meshnet.relay.frames`), and the answer comes back the same way, streamed.

Errors: a node id that never attached is 404 ``relay_unknown_node``; one whose tunnel is down
(it is reconnecting) is 503 ``relay_node_detached`` with ``Retry-After``; a request body over
``max_body_bytes`` is 413; a node that aborts an exchange before answering is 502.

The tracker hosts a hub, and so does a node started with ``--offer-relay``; each passes its own
``authorize`` (who may attach as which node id).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from meshnet.errors import InvalidRequest, MeshnetError, NotFound, PayloadTooLarge, Unavailable
from meshnet.protocol.http import error_response
from meshnet.protocol.route import RELAY_PATH
from meshnet.relay.frames import MAX_CHUNK_BYTES, Frame, Kind, decode_frame, encode_frame, json_frame

log = logging.getLogger(__name__)

__all__ = ["Authorize", "DEFAULT_RELAY_BODY_BYTES", "RelayDetached", "RelayHub", "TUNNEL_PATH", "attach_target",
           "relay_prefix"]

#: where a node attaches its tunnel (WebSocket), ``{node_id}`` filled in
TUNNEL_PATH = "/v1/tunnel/{node_id}"


def attach_target(host: str, path: str) -> str:
    """What a tunnel's attach is signed over: the relay's host as the node dialled it (the
    request's ``Host``, e.g. ``tracker.example:8700``) and the path, ``//host/path``; so an attach
    replayed at another relay, whose host differs, is refused (ADR-0045)."""
    return f"//{host.lower()}{path}"
#: headers that belong to one connection and never cross the tunnel
_HOP_BY_HOP = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer",
                         "proxy-connection", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                         "sec-websocket-accept", "sec-websocket-protocol"})
#: how long a tunnelled request may wait for the node's answer head, seconds
RESPONSE_HEAD_TIMEOUT_S = 600.0
#: largest tunnelled request body by default: the wire format's largest activation frame (256 MiB)
#: plus its header, so a relayed hop takes every frame a direct one does
DEFAULT_RELAY_BODY_BYTES = 256 * 1024 * 1024 + 64
#: what a detached node's 503 asks callers to wait, seconds
RETRY_AFTER_S = 2

#: who may attach: ``await authorize(node_id, headers, method, target)`` raises (401/403/404) or returns
Authorize = Callable[[str, Mapping[str, str], str, str], Awaitable[None]]


async def until_one_ends(*coros: Awaitable[None]) -> None:
    """Run the pumps ``coros`` (the two directions of a tunnelled WebSocket) until one returns or
    raises, then cancel the others and wait for them (their errors are dropped: the channel ends)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def relay_prefix(relay_url: str, node_id: str) -> str:
    """The endpoint a relayed node advertises: ``{relay_url}/v1/relay/{node_id}``."""
    return f"{relay_url.rstrip('/')}{RELAY_PATH}{node_id}"


def forwardable(headers: Mapping[str, str] | list[tuple[str, str]]) -> list[list[str]]:
    """Request or response headers that may cross the tunnel (hop-by-hop ones dropped), as pairs."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    return [[k, v] for k, v in items if k.lower() not in _HOP_BY_HOP]


class Tunnel:
    """One attached node's WebSocket, with the channels open on it."""

    def __init__(self, node_id: str, ws: WebSocket) -> None:
        self.node_id, self.ws = node_id, ws
        self.channels: dict[int, asyncio.Queue[Frame]] = {}
        self._ids = itertools.count(1, 2)
        self._send_lock = asyncio.Lock()
        self.closed = asyncio.Event()

    def open_channel(self) -> tuple[int, asyncio.Queue[Frame]]:
        channel = next(self._ids)
        self.channels[channel] = queue = asyncio.Queue()
        return channel, queue

    def close_channel(self, channel: int) -> None:
        self.channels.pop(channel, None)

    async def send(self, data: bytes) -> None:
        """Send one encoded frame.

        Raises:
            ServiceUnavailable (503 ``relay_node_detached``): the tunnel is closed.
        """
        if self.closed.is_set():
            raise _detached(self.node_id)
        try:
            async with self._send_lock:
                await self.ws.send_bytes(data)
        except Exception as exc:  # noqa: BLE001 - any send failure means the tunnel is gone
            self.closed.set()
            raise _detached(self.node_id) from exc

    async def read_loop(self) -> None:
        """Deliver incoming frames to their channels until the node goes; then abort every channel."""
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                data = message.get("bytes")
                if data is None:
                    log.warning("tunnel of %s sent a text message; ignored", self.node_id)
                    continue
                try:
                    frame = decode_frame(data)
                except MeshnetError as exc:
                    log.warning("tunnel of %s: %s", self.node_id, exc.message)
                    continue
                queue = self.channels.get(frame.channel)
                if queue is not None:
                    queue.put_nowait(frame)
        finally:
            self.closed.set()
            for channel, queue in list(self.channels.items()):
                queue.put_nowait(Frame(Kind.CLOSE, channel, b'{"reason":"tunnel closed"}'))


class RelayDetached(Unavailable):
    """A relayed node's tunnel is down (HTTP 503 ``relay_node_detached``, ``Retry-After``)."""

    code = "relay_node_detached"
    retry_after_s = RETRY_AFTER_S


def _detached(node_id: str) -> RelayDetached:
    return RelayDetached(f"node {node_id!r} is relayed here but its tunnel is down (it reconnects by itself)",
                         hint="retry in a few seconds; the tracker routes around it meanwhile")


class RelayHub:
    """Tunnels by node id. ``on_attach(node_id)`` / ``on_detach(node_id)`` tell the host (the tracker
    probes an attached node at once and marks a detached one unreachable).

    Args:
        authorize: checks an attach's signature (see :data:`Authorize`).
        max_body_bytes: largest tunnelled request body (413 above).
    """

    def __init__(self, authorize: Authorize, *, max_body_bytes: int,
                 on_attach: Callable[[str], None] | None = None,
                 on_detach: Callable[[str], None] | None = None) -> None:
        self.authorize, self.max_body_bytes = authorize, max_body_bytes
        self.on_attach, self.on_detach = on_attach, on_detach
        self.tunnels: dict[str, Tunnel] = {}
        self.detached_at: dict[str, float] = {}  # node id -> unix time its last tunnel closed

    def tunnel(self, node_id: str) -> Tunnel:
        """The live tunnel of ``node_id``.

        Raises:
            NotFound (404 ``relay_unknown_node``): never attached here.
            ServiceUnavailable (503 ``relay_node_detached``): attached before, down now.
        """
        tunnel = self.tunnels.get(node_id)
        if tunnel is not None and not tunnel.closed.is_set():
            return tunnel
        if node_id in self.detached_at or tunnel is not None:
            raise _detached(node_id)
        raise NotFound(f"node {node_id!r} has no tunnel on this relay", code="relay_unknown_node",
                       hint="a relayed node attaches itself at start; check the node's --relay-url and its log")

    def routes(self) -> list:
        return [WebSocketRoute(TUNNEL_PATH, self.attach),
                Route("/v1/relay/{node_id}/{path:path}", self.relay_http,
                      methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
                WebSocketRoute("/v1/relay/{node_id}/{path:path}", self.relay_ws)]

    # ---- the node's side: attach --------------------------------------------------------

    async def attach(self, ws: WebSocket) -> None:
        """A node attaches its tunnel (signed as that node); a newer tunnel replaces an older one."""
        node_id = ws.path_params["node_id"]
        target = attach_target(ws.headers.get("host", ""), ws.url.path + (f"?{ws.url.query}" if ws.url.query else ""))
        try:
            await self.authorize(node_id, ws.headers, "GET", target)
        except MeshnetError as exc:
            log.warning("refused a tunnel for %s: %s", node_id, exc.message)
            await _deny(ws, exc)
            return
        await ws.accept()
        tunnel = Tunnel(node_id, ws)
        old = self.tunnels.get(node_id)
        self.tunnels[node_id] = tunnel
        self.detached_at.pop(node_id, None)
        if old is not None:
            log.info("node %s attached a new tunnel; the old one is closed", node_id)
            old.closed.set()
            with contextlib.suppress(Exception):
                await old.ws.close(code=1012)
        log.info("node %s attached its tunnel", node_id)
        if self.on_attach:
            self.on_attach(node_id)
        try:
            await tunnel.read_loop()
        finally:
            if self.tunnels.get(node_id) is tunnel:
                del self.tunnels[node_id]
                self.detached_at[node_id] = time.time()
                log.info("node %s's tunnel closed", node_id)
                if self.on_detach:
                    self.on_detach(node_id)

    # ---- the callers' side: HTTP --------------------------------------------------------

    async def relay_http(self, request: Request) -> Response:
        """Pass one HTTP request to the node through its tunnel; its answer streams back. The hub's own
        refusals (404, 413, 502, 503, 504) are rendered here, whatever app it is mounted in."""
        try:
            return await self._relay_http(request)
        except MeshnetError as exc:
            return error_response(exc)

    async def _relay_http(self, request: Request) -> Response:
        tunnel = self.tunnel(request.path_params["node_id"])
        channel, queue = tunnel.open_channel()
        try:
            head = {"method": request.method, "path": "/" + request.path_params["path"],
                    "query": request.url.query, "headers": forwardable(request.headers)}
            await tunnel.send(json_frame(Kind.OPEN_HTTP, channel, head))
            await self._send_body(tunnel, channel, request)
            first = await _next(queue, RESPONSE_HEAD_TIMEOUT_S, tunnel.node_id)
        except BaseException:
            await _abort(tunnel, channel)
            raise
        if first.kind != Kind.RESPONSE:
            tunnel.close_channel(channel)
            reason = first.json().get("reason", "no reason given") if first.kind == Kind.CLOSE else first.kind.name
            raise MeshnetError(f"relayed node {tunnel.node_id} gave no answer: {reason}", code="relay_bad_gateway",
                               status=502)
        answer = first.json()
        return StreamingResponse(self._body(tunnel, channel, queue), status_code=int(answer.get("status", 502)),
                                 headers=dict(_pairs(answer.get("headers", []))))

    async def _send_body(self, tunnel: Tunnel, channel: int, request: Request) -> None:
        received, pending = 0, b""
        async for piece in request.stream():
            received += len(piece)
            if received > self.max_body_bytes:
                raise PayloadTooLarge(f"request body over {self.max_body_bytes} bytes for a relayed node")
            pending += piece
            while len(pending) >= MAX_CHUNK_BYTES:
                await tunnel.send(encode_frame(Frame(Kind.DATA, channel, pending[:MAX_CHUNK_BYTES])))
                pending = pending[MAX_CHUNK_BYTES:]
        if pending:
            await tunnel.send(encode_frame(Frame(Kind.DATA, channel, pending)))
        await tunnel.send(encode_frame(Frame(Kind.END, channel)))

    async def _body(self, tunnel: Tunnel, channel: int, queue: asyncio.Queue[Frame]) -> AsyncIterator[bytes]:
        ended = False
        try:
            while True:
                frame = await _next(queue, RESPONSE_HEAD_TIMEOUT_S, tunnel.node_id)
                if frame.kind == Kind.DATA:
                    yield frame.payload
                elif frame.kind == Kind.END:
                    ended = True
                    return
                else:  # CLOSE: the node aborted mid-answer; cut the stream (the caller sees it end early)
                    ended = True
                    raise ConnectionAbortedError(f"relayed node {tunnel.node_id} aborted its answer")
        finally:
            if not ended:
                await _abort(tunnel, channel)
            tunnel.close_channel(channel)

    # ---- the callers' side: WebSocket ---------------------------------------------------

    async def relay_ws(self, ws: WebSocket) -> None:
        """Pass one WebSocket connection to the node through its tunnel, messages both ways."""
        try:
            tunnel = self.tunnel(ws.path_params["node_id"])
        except MeshnetError as exc:
            await _deny(ws, exc)
            return
        channel, queue = tunnel.open_channel()
        protocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        head = {"path": "/" + ws.path_params["path"], "query": ws.url.query, "headers": forwardable(ws.headers),
                "subprotocols": protocols}
        try:
            await tunnel.send(json_frame(Kind.OPEN_WS, channel, head))
            first = await _next(queue, RESPONSE_HEAD_TIMEOUT_S, tunnel.node_id)
        except MeshnetError as exc:
            tunnel.close_channel(channel)
            await _deny(ws, exc)
            return
        if first.kind != Kind.WS_ACCEPT:
            tunnel.close_channel(channel)
            reason = first.json().get("reason", "refused") if first.kind == Kind.CLOSE else first.kind.name
            await _deny(ws, MeshnetError(f"relayed node {tunnel.node_id} refused the WebSocket: {reason}",
                                         code="relay_bad_gateway", status=502))
            return
        await ws.accept(subprotocol=first.json().get("subprotocol"))
        await _pump_ws(ws, tunnel, channel, queue)


async def _pump_ws(ws: WebSocket, tunnel: Tunnel, channel: int, queue: asyncio.Queue[Frame]) -> None:
    """Messages caller → node and node → caller until either side closes."""

    async def upstream() -> None:
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    await tunnel.send(json_frame(Kind.CLOSE, channel, {"code": message.get("code", 1000)}))
                    return
                if message.get("bytes") is not None:
                    await tunnel.send(encode_frame(Frame(Kind.WS_BINARY, channel, message["bytes"])))
                elif message.get("text") is not None:
                    await tunnel.send(encode_frame(Frame(Kind.WS_TEXT, channel, message["text"].encode())))
        except (MeshnetError, WebSocketDisconnect):
            return

    async def downstream() -> None:
        while True:
            frame = await queue.get()
            if frame.kind == Kind.WS_BINARY:
                await ws.send_bytes(frame.payload)
            elif frame.kind == Kind.WS_TEXT:
                await ws.send_text(frame.payload.decode())
            elif frame.kind == Kind.CLOSE:
                info = frame.json()
                with contextlib.suppress(Exception):
                    await ws.close(code=int(info.get("code", 1011)), reason=str(info.get("reason", ""))[:120])
                return

    try:
        await until_one_ends(upstream(), downstream())
    finally:
        tunnel.close_channel(channel)


async def _next(queue: asyncio.Queue[Frame], timeout_s: float, node_id: str) -> Frame:
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: it can swallow a cancel on 3.11
            return await queue.get()
    except asyncio.TimeoutError:
        raise MeshnetError(f"relayed node {node_id} did not answer within {timeout_s:.0f} s",
                           code="relay_timeout", status=504) from None


async def _abort(tunnel: Tunnel, channel: int) -> None:
    """Tell the node to drop a channel (its caller went away); never raises."""
    tunnel.close_channel(channel)
    with contextlib.suppress(Exception):
        await tunnel.send(json_frame(Kind.CLOSE, channel, {"reason": "caller gone"}))


async def _deny(ws: WebSocket, exc: MeshnetError) -> None:
    """Refuse a WebSocket handshake with the error envelope when the server can send one, else a close code."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(error_response(exc))
    else:
        await ws.close(code=4000 + exc.status if exc.status < 1000 else 1011, reason=exc.message[:120])


def _pairs(raw: object) -> list[tuple[str, str]]:
    if not isinstance(raw, list):
        raise InvalidRequest("tunnel RESPONSE headers must be a list of pairs", code="bad_frame")
    return [(str(k), str(v)) for k, v in raw if isinstance(k, str)]

