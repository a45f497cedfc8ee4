"""Outbound hop streams of one node: one WebSocket per peer, shared by every session (ADR-0040).

A node sends every stream message (:mod:`meshnet.dataplane.frames`) to a peer over one
persistent WebSocket to ``<peer endpoint>/v1/stream``, opened on first use and kept for all
later sessions: a session costs no connection set-up once its peers have been reached. The
messages of many sessions are multiplexed on it (each carries its chain id), in the order they
were sent. A reader task per connection hands whatever the peer sends back to the same
``on_message`` callback the node's own stream endpoint uses, so a connection works both ways.

Messages sent to one peer in the same turn of the event loop leave together as one BUNDLE
message (:func:`meshnet.dataplane.frames.bundle`): the results of a node's batch reach their
chains at once, and their steps go on to the next hop in one WebSocket message, not one each
(ADR-0040's bundle amendment). A message sent alone goes as it is, and so does every message to
a peer that did not accept the :data:`~meshnet.dataplane.frames.READS_BUNDLES` subprotocol when
its stream opened (a node from before bundles, which would drop them).

A send that fails on a connection opened earlier (the peer restarted, an idle timeout) is tried
once more on a fresh connection; a peer that cannot be reached raises :class:`PeerUnreachable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from meshnet.errors import MeshnetError
from meshnet.dataplane.frames import READS_BUNDLES, bundle, stream_url

log = logging.getLogger(__name__)

#: the largest stream message accepted, bytes: a 128-token chunk of a wide model in float32 plus headers
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

OnMessage = Callable[[bytes], Awaitable[None]]
class PeerUnreachable(MeshnetError):
    """A peer's stream could not be opened or written to within the timeouts (HTTP 502)."""

    status = 502
    code = "hop_unreachable"


class StreamPool:
    """One node's outbound streams, keyed by the peer's stream URL.

    Args:
        on_message: called with every message a peer sends back on a connection opened here.
        connect_timeout_s: to open a stream (TCP and the WebSocket handshake), seconds.
        send_timeout_s: to hand one message to the socket, seconds (a peer that stopped reading
            fills the buffers; the send then fails instead of waiting for ever).
    """

    def __init__(self, on_message: OnMessage | None = None, *, connect_timeout_s: float = 5.0,
                 send_timeout_s: float = 30.0) -> None:
        self.on_message = on_message
        #: messages and bytes sent (``"out"``) and received (``"in"``) on these connections, counted
        #: in place (the node's metrics read them: no call per message)
        self.traffic = {"in": [0, 0], "out": [0, 0]}
        self.connect_timeout_s, self.send_timeout_s = connect_timeout_s, send_timeout_s
        self._conns: dict[str, ClientConnection] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._readers: set[asyncio.Task] = set()
        self._queued: dict[str, list[tuple[bytes, asyncio.Future]]] = {}  # url -> messages not yet written
        self._flushers: dict[str, asyncio.Task] = {}  # url -> the task writing its queued messages
        self.opened = 0  # connections opened since start (a test checks that sessions reuse them)
        self.written = 0  # WebSocket messages written since start (a bundle counts once)

    def __len__(self) -> int:
        return len(self._conns)

    async def send(self, endpoint: str, data: bytes) -> None:
        """Send one message to the node at ``endpoint`` (its base URL, which may carry a path
        prefix); returns once it was handed to the socket. Messages sent to one peer in the same
        turn of the loop go as one BUNDLE, in the order they were sent, where the peer reads bundles.

        Raises:
            PeerUnreachable: no stream could be opened, or the message could not be written on a
                fresh one, within the timeouts (each caller gets its own error).
        """
        url = stream_url(endpoint)
        future = asyncio.get_running_loop().create_future()
        self._queued.setdefault(url, []).append((data, future))
        if url not in self._flushers:  # runs on the loop's next turn, after this turn's other sends
            self._flushers[url] = asyncio.get_running_loop().create_task(self._flush(url))
        await future

    async def _flush(self, url: str) -> None:
        """Write ``url``'s queued messages, a batch of them at a time (:meth:`_write`), until none
        is left; settle each sender's future."""
        queued: list[tuple[bytes, asyncio.Future]] = []
        try:
            while url in self._queued:
                queued = self._queued.pop(url)
                try:
                    await self._write(url, [data for data, _ in queued])
                except Exception as exc:  # noqa: BLE001 - every sender hears of it, none waits for ever
                    message = exc.message if isinstance(exc, PeerUnreachable) else f"{type(exc).__name__}: {exc}"
                    for _, future in queued:
                        if not future.done():
                            future.set_exception(PeerUnreachable(message, hint=getattr(exc, "hint", None)))
                    continue
                for _, future in queued:
                    if not future.done():
                        future.set_result(None)
        finally:
            for _, future in queued:  # cancelled while writing them (the pool closed)
                if not future.done():
                    future.set_exception(PeerUnreachable("the node's streams were closed"))
            if self._flushers.get(url) is asyncio.current_task():
                del self._flushers[url]

    async def _write(self, url: str, messages: list[bytes]) -> None:
        """Write ``messages`` to ``url``: as one BUNDLE where the peer accepted
        :data:`~meshnet.dataplane.frames.READS_BUNDLES` and there are several, else one WebSocket
        message each; all again on a fresh connection when the open one fails.

        Raises:
            PeerUnreachable: see :meth:`send`.
        """
        for attempt in (0, 1):
            conn, fresh = await self._connection(url)
            frames = [bundle(messages)] if len(messages) > 1 and conn.subprotocol == READS_BUNDLES else messages
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    for data in frames:
                        await conn.send(data)
            except (WebSocketException, OSError, TimeoutError) as exc:
                self._forget(url, conn)
                if fresh or attempt:
                    raise PeerUnreachable(f"could not send on the stream to {url}: {type(exc).__name__}: {exc}",
                                          hint="the node stopped or its endpoint is unreachable") from exc
                continue
            self.written += len(frames)
            out = self.traffic["out"]
            out[0] += len(frames)
            for data in frames:
                out[1] += len(data)
            return

    async def _connection(self, url: str) -> tuple[ClientConnection, bool]:
        """The open stream to ``url`` and whether it was opened by this call."""
        conn = self._conns.get(url)
        if conn is not None:
            return conn, False
        lock = self._opening.setdefault(url, asyncio.Lock())
        async with lock:
            conn = self._conns.get(url)
            if conn is not None:
                return conn, False
            try:
                conn = await connect(url, open_timeout=self.connect_timeout_s, compression=None, proxy=None,
                                     subprotocols=[READS_BUNDLES], max_size=MAX_MESSAGE_BYTES, max_queue=None,
                                     ping_interval=20, ping_timeout=20)
            except (WebSocketException, OSError, TimeoutError) as exc:
                raise PeerUnreachable(f"could not open a stream to {url}: {type(exc).__name__}: {exc}",
                                      hint="the node stopped, or its endpoint is wrong or unreachable") from exc
            self._conns[url] = conn
            self.opened += 1
            task = asyncio.get_running_loop().create_task(self._read(url, conn))
            self._readers.add(task)
            task.add_done_callback(self._readers.discard)
            return conn, True

    async def _read(self, url: str, conn: ClientConnection) -> None:
        """Hand every message the peer sends on ``conn`` to ``on_message`` until it closes."""
        try:
            async for data in conn:
                if not isinstance(data, bytes):
                    continue
                received = self.traffic["in"]
                received[0] += 1
                received[1] += len(data)
                if self.on_message is not None:
                    try:
                        await self.on_message(data)
                    except Exception:  # noqa: BLE001 - one bad message must not close a shared stream
                        log.warning("stream message from %s not handled", url, exc_info=True)
        except WebSocketException:
            pass
        finally:
            self._forget(url, conn)

    def _forget(self, url: str, conn: ClientConnection) -> None:
        if self._conns.get(url) is conn:
            del self._conns[url]

    async def close(self) -> None:
        """Close every stream and stop its reader (waits at most a second for each close)."""
        for task in list(self._flushers.values()):
            task.cancel()
        for queued in self._queued.values():
            for _, future in queued:
                if not future.done():
                    future.set_exception(PeerUnreachable("the node's streams were closed"))
        self._queued.clear()
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await conn.close()
        for task in list(self._readers):
            task.cancel()
        if self._readers:
            await asyncio.wait(list(self._readers), timeout=1.0)
