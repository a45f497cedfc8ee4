"""The node side of the relay (ADR-0045): one outbound tunnel, replayed against the node's own listener.

:class:`NodeTunnel` dials ``{relay}/v1/tunnel/{node_id}`` (a WebSocket, signed with the node's
key), then serves what comes through it: each ``OPEN_HTTP`` channel becomes one request to the
node's local listener (``local_url``, e.g. ``http://127.0.0.1:8821``) whose answer streams
back; each ``OPEN_WS`` channel becomes one WebSocket to the local listener, messages passed
both ways. When the tunnel drops (the relay restarts, the network goes away, a keepalive ping
goes unanswered for ``ping_timeout_s``) it dials again after a bounded, jittered back-off
(:class:`meshnet.relay.backoff.Backoff`), for as long as the node runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.headers import build_host
from websockets.uri import parse_uri

from meshnet.errors import MeshnetError
from meshnet.protocol.signing import sign_request
from meshnet.relay.backoff import Backoff
from meshnet.relay.frames import MAX_CHUNK_BYTES, MAX_FRAME_BYTES, Frame, Kind, decode_frame, encode_frame, json_frame
from meshnet.relay.hub import TUNNEL_PATH, attach_target, forwardable, relay_prefix, until_one_ends

log = logging.getLogger(__name__)

__all__ = ["NodeTunnel", "ws_url"]


def ws_url(http_url: str) -> str:
    """``http://…`` → ``ws://…``, ``https://…`` → ``wss://…`` (anything else unchanged)."""
    if http_url.startswith("https://"):
        return "wss://" + http_url[len("https://"):]
    if http_url.startswith("http://"):
        return "ws://" + http_url[len("http://"):]
    return http_url


#: keepalive of a tunnel, seconds: a silent relay is given up after about their sum
PING_INTERVAL_S, PING_TIMEOUT_S = 2.0, 4.0
#: the longest a tunnelled request may take on the node's own listener, seconds (a long generation)
LOCAL_TIMEOUT_S = 600.0


class NodeTunnel:
    """Keeps node ``node_id`` attached to the relay at ``relay_url``.

    Args:
        relay_url: the relay's base URL (the tracker's, or a node's started with ``--offer-relay``).
        node_id, key: who attaches; the attach is signed with ``key`` (ADR-0035).
        local_url: the node's own listener, where tunnelled requests are replayed.
        on_attached: called after every successful attach (the node re-registers or the host probes).
        backoff: delays between attempts to dial again.

    Attributes:
        endpoint: what the node advertises while relayed: ``{relay_url}/v1/relay/{node_id}``.
        attached: set while a tunnel is open.
        rtt_s: the tunnel's latest keepalive round trip, seconds (0.0 before the first ping).
        attaches: how many times a tunnel was opened (the first one and every reconnection).
    """

    def __init__(self, relay_url: str, node_id: str, key: Ed25519PrivateKey, local_url: str, *,
                 on_attached: Callable[[], None] | None = None, backoff: Backoff | None = None) -> None:
        self.relay_url, self.node_id, self.key = relay_url.rstrip("/"), node_id, key
        self.local_url = local_url.rstrip("/")
        self.endpoint = relay_prefix(self.relay_url, node_id)
        wsuri = parse_uri(ws_url(self.relay_url) + "/")
        self.relay_host = build_host(wsuri.host, wsuri.port, wsuri.secure)  # the Host the relay will see
        self.on_attached = on_attached
        self.ping_interval_s, self.ping_timeout_s = PING_INTERVAL_S, PING_TIMEOUT_S
        self.backoff = backoff or Backoff(0.5, 5.0)
        self.local_timeout_s = LOCAL_TIMEOUT_S
        self.attached = asyncio.Event()
        self.attaches = 0
        self._down_since: float | None = time.monotonic()  # not attached since (None: attached)
        self.last_error: str | None = None
        self._conn: ClientConnection | None = None
        self._send_lock = asyncio.Lock()
        self._channels: dict[int, asyncio.Queue[Frame]] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def rtt_s(self) -> float:
        conn = self._conn
        return float(conn.latency) if conn is not None and self.attached.is_set() else 0.0

    def down_for_s(self) -> float:
        """Seconds since the tunnel was last attached (since it was made, before the first attach;
        0.0 while attached)."""
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    async def run(self) -> None:
        """Attach, serve, and attach again whenever the tunnel drops (until cancelled)."""
        path = TUNNEL_PATH.format(node_id=self.node_id)
        # the node's own listener: never through a proxy from the environment
        async with httpx.AsyncClient(base_url=self.local_url, timeout=self.local_timeout_s, trust_env=False) as local:
            while True:
                try:
                    headers = sign_request(self.key, self.node_id, "GET", attach_target(self.relay_host, path), b"")
                    async with connect(ws_url(self.relay_url) + path, additional_headers=headers,
                                       max_size=MAX_FRAME_BYTES, ping_interval=self.ping_interval_s,
                                       ping_timeout=self.ping_timeout_s, open_timeout=5.0, proxy=None) as conn:
                        self._conn = conn
                        self.attaches += 1
                        self.attached.set()
                        self._down_since = None
                        self.backoff.reset()
                        self.last_error = None
                        log.info("tunnel to %s attached; this node is reachable at %s", self.relay_url, self.endpoint)
                        if self.on_attached:
                            self.on_attached()
                        await self._serve(conn, local)
                    self.last_error = "the relay closed the tunnel"
                except asyncio.CancelledError:
                    raise
                except InvalidStatus as exc:
                    self.last_error = f"the relay refused the tunnel: HTTP {exc.response.status_code} " \
                                      f"{exc.response.body[:300]!r}"
                except Exception as exc:  # noqa: BLE001 - any failure: dial again after the back-off
                    self.last_error = f"{type(exc).__name__}: {exc}"
                finally:
                    self._drop_all()
                delay = self.backoff.next_delay_s()
                log.warning("tunnel to %s down (%s); dialling again in %.1f s", self.relay_url, self.last_error, delay)
                await asyncio.sleep(delay)

    def _drop_all(self) -> None:
        if self.attached.is_set() or self._down_since is None:
            self._down_since = time.monotonic()
        self.attached.clear()
        self._conn = None
        for task in list(self._tasks):
            task.cancel()
        self._channels.clear()

    async def _send(self, conn: ClientConnection, data: bytes) -> None:
        async with self._send_lock:
            await conn.send(data)

    async def _serve(self, conn: ClientConnection, local: httpx.AsyncClient) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in conn:
                try:
                    frame = decode_frame(message)
                except MeshnetError as exc:
                    log.warning("tunnel: %s", exc.message)
                    continue
                if frame.kind in (Kind.OPEN_HTTP, Kind.OPEN_WS):
                    queue: asyncio.Queue[Frame] = asyncio.Queue()
                    self._channels[frame.channel] = queue
                    work = self._http if frame.kind == Kind.OPEN_HTTP else self._ws
                    task = asyncio.create_task(work(conn, local, frame, queue))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif (queue := self._channels.get(frame.channel)) is not None:
                    queue.put_nowait(frame)

    async def _http(self, conn: ClientConnection, local: httpx.AsyncClient, opening: Frame,
                    queue: asyncio.Queue[Frame]) -> None:
        """Replay one tunnelled HTTP request locally; stream its answer back."""
        channel = opening.channel
        try:
            head = opening.json()
            body = bytearray()
            while (frame := await queue.get()).kind == Kind.DATA:
                body += frame.payload
            if frame.kind != Kind.END:
                return  # CLOSE: the caller went away before its body was complete
            url = head["path"] + (f"?{head['query']}" if head.get("query") else "")
            request = local.build_request(head["method"], url, headers=[tuple(p) for p in head.get("headers", [])],
                                          content=bytes(body))
            answer = asyncio.create_task(local.send(request, stream=True))
            aborted = asyncio.create_task(_until_close(queue))
            done, _ = await asyncio.wait({answer, aborted}, return_when=asyncio.FIRST_COMPLETED)
            if aborted in done:
                answer.cancel()
                return
            aborted.cancel()
            resp = answer.result()
            try:
                await self._send(conn, json_frame(Kind.RESPONSE, channel, {
                    "status": resp.status_code, "headers": forwardable(list(resp.headers.multi_items()))}))
                async for piece in resp.aiter_raw(MAX_CHUNK_BYTES):
                    if not queue.empty() and (await queue.get()).kind == Kind.CLOSE:
                        return  # the caller went away mid-answer (a cancelled stream)
                    await self._send(conn, encode_frame(Frame(Kind.DATA, channel, piece)))
                await self._send(conn, encode_frame(Frame(Kind.END, channel)))
            finally:
                await resp.aclose()
        except (ConnectionClosed, asyncio.CancelledError):
            return
        except Exception as exc:  # noqa: BLE001 - the caller gets a 502 naming the cause
            log.warning("tunnelled %s failed: %s: %s", opening.json().get("path"), type(exc).__name__, exc)
            with contextlib.suppress(Exception):
                await self._send(conn, json_frame(Kind.CLOSE, channel, {"reason": f"{type(exc).__name__}: {exc}"}))
        finally:
            self._channels.pop(channel, None)

    async def _ws(self, conn: ClientConnection, local: httpx.AsyncClient, opening: Frame,
                  queue: asyncio.Queue[Frame]) -> None:
        """Open one tunnelled WebSocket on the local listener; pass messages both ways until either closes."""
        channel = opening.channel
        try:
            head = opening.json()
            url = ws_url(self.local_url) + head["path"] + (f"?{head['query']}" if head.get("query") else "")
            headers = [tuple(p) for p in head.get("headers", []) if p[0].lower() not in ("origin", "cookie")]
            try:
                inner = await connect(url, additional_headers=headers, subprotocols=head.get("subprotocols") or None,
                                      max_size=MAX_FRAME_BYTES, open_timeout=10.0, proxy=None)
            except InvalidStatus as exc:
                await self._send(conn, json_frame(Kind.CLOSE, channel, {
                    "code": 1008, "reason": f"HTTP {exc.response.status_code} {exc.response.body[:200]!r}"}))
                return
            async with inner:
                await self._send(conn, json_frame(Kind.WS_ACCEPT, channel, {"subprotocol": inner.subprotocol}))
                await _pump(inner, queue, lambda data: self._send(conn, data), channel)
        except (ConnectionClosed, asyncio.CancelledError):
            return
        except Exception as exc:  # noqa: BLE001 - the caller's WebSocket is refused or closed with the cause
            with contextlib.suppress(Exception):
                await self._send(conn, json_frame(Kind.CLOSE, channel, {"code": 1011,
                                                                        "reason": f"{type(exc).__name__}: {exc}"}))
        finally:
            self._channels.pop(channel, None)


async def _until_close(queue: asyncio.Queue[Frame]) -> None:
    while (await queue.get()).kind != Kind.CLOSE:
        pass


async def _pump(inner: ClientConnection, queue: asyncio.Queue[Frame], send, channel: int) -> None:
    """Local WebSocket ``inner`` ↔ tunnel channel, until either side closes."""

    async def to_local() -> None:
        while True:
            frame = await queue.get()
            if frame.kind == Kind.WS_BINARY:
                await inner.send(frame.payload)
            elif frame.kind == Kind.WS_TEXT:
                await inner.send(frame.payload.decode())
            elif frame.kind == Kind.CLOSE:
                await inner.close(code=int(frame.json().get("code", 1000)))
                return

    async def to_caller() -> None:
        try:
            async for message in inner:
                kind = Kind.WS_TEXT if isinstance(message, str) else Kind.WS_BINARY
                await send(encode_frame(Frame(kind, channel, message.encode() if isinstance(message, str) else message)))
        except ConnectionClosed:
            pass
        code = inner.close_code or 1000
        await send(json_frame(Kind.CLOSE, channel, {"code": 1000 if code == 1005 else code,
                                                    "reason": inner.close_reason or ""}))

    await until_one_ends(to_local(), to_caller())
