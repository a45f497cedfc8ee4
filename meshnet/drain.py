"""Drain: how a meshnet service stops without cutting anyone off (ADR-0032).

SIGTERM does not stop a service at once. The process first *drains*: it takes no new work
(a new chat is a 503 ``draining``, so callers go elsewhere at once) and says so to whoever
routes to it (``announce``), lets the work already in flight finish for up to a grace
period, then leaves (``leave``: a node deregisters), and only then lets the HTTP server
close its sockets. A stream still open when the grace runs out ends with an error event,
never silently.

:class:`Drain` is that state for one process and knows nothing of uvicorn;
:class:`DrainMiddleware` counts and, past the grace, cuts the requests that are work
(chat completions); :mod:`meshnet.cli.server` calls :meth:`Drain.run` on the first SIGTERM.
Torch-free: the tracker uses it too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable

from starlette.responses import StreamingResponse

from meshnet.errors import Draining, MeshnetError
from meshnet.protocol.http import route_path, sse_error

log = logging.getLogger(__name__)

#: async hook run by :meth:`Drain.run` (``announce`` or ``leave``)
Hook = Callable[[], Awaitable[None]]


class Drain:
    """Drain state of one service process.

    Args:
        grace_s: seconds in-flight work may take to finish once draining starts; past it the
            rest is cut (streams end with an error event). 0 cuts at once.
        poll_s: how often :meth:`run` checks for idleness, seconds.
        cut_linger_s: after a cut, how long :meth:`run` waits for the cut requests to write
            their error events before it leaves, seconds.

    Attributes:
        draining: True from the first :meth:`run` on; new work is refused.
        in_flight: requests counted by :class:`DrainMiddleware` right now.
        cut: set when the grace ran out; the middleware then ends what is still open.
        announce, leave: hooks the app sets (tell the tracker; deregister). Either may be None.
        idle: extra idleness test of the app (a node: no live hop sessions); default always idle.
    """

    def __init__(self, grace_s: float = 30.0, *, poll_s: float = 0.1, cut_linger_s: float = 1.0) -> None:
        if grace_s < 0:
            raise ValueError(f"drain grace must be >= 0 s, got {grace_s}")
        self.grace_s, self.poll_s, self.cut_linger_s = grace_s, poll_s, cut_linger_s
        self.draining = False
        self.in_flight = 0
        self.cut = asyncio.Event()
        self.announce: Hook | None = None
        self.leave: Hook | None = None
        self.idle: Callable[[], bool] = lambda: True
        self.started_s: float | None = None  # monotonic start of the drain
        self._done = asyncio.Event()
        self.clean: bool | None = None  # result of the finished drain

    def refuse_new(self, what: str = "new work") -> None:
        """Raise when draining: a caller should go elsewhere.

        Raises:
            Draining: 503 ``draining`` with ``Retry-After: 1``.
        """
        if self.draining:
            raise Draining(f"this service is draining before it exits and takes no {what}",
                           hint="retry elsewhere: the tracker routes around a draining node")

    def is_idle(self) -> bool:
        """No counted request in flight and the app's own idleness test holds."""
        return self.in_flight == 0 and self.idle()

    async def run(self) -> bool:
        """Drain once: announce, wait until idle (at most ``grace_s``), cut the rest, leave.

        A hook that raises is logged and skipped (a tracker that is down must not keep a
        node from exiting). A second call waits for the first drain and returns its result.

        Returns:
            True when nothing had to be cut.
        """
        if self.draining:
            await self._done.wait()
            return bool(self.clean)
        self.draining = True
        self.started_s = time.monotonic()
        log.info("draining: no new work; up to %.0f s for %d request(s) in flight", self.grace_s, self.in_flight)
        await self._hook(self.announce, "announce")
        deadline = self.started_s + self.grace_s
        while not self.is_idle() and time.monotonic() < deadline:
            await asyncio.sleep(self.poll_s)
        self.clean = self.is_idle()
        if not self.clean:
            log.warning("drain grace of %.0f s ran out with %d request(s) in flight: cutting them",
                        self.grace_s, self.in_flight)
            self.cut.set()
            linger = time.monotonic() + self.cut_linger_s
            while self.in_flight and time.monotonic() < linger:
                await asyncio.sleep(self.poll_s)
        await self._hook(self.leave, "leave")
        log.info("drained in %.1f s (%s)", time.monotonic() - self.started_s, "clean" if self.clean else "cut")
        self._done.set()
        return self.clean

    async def _hook(self, hook: Hook | None, name: str) -> None:
        if hook is None:
            return
        try:
            await hook()
        except Exception:  # noqa: BLE001 - a failed hook must never keep the process from exiting
            log.exception("drain %s hook failed; going on", name)


class DrainGroup:
    """The drains of services that share one process (the tracker serving layers, ADR-0044), run
    as one: :meth:`run` drains them all at once, and they share one ``cut`` event, so a second
    signal cuts every one of them. It offers what :mod:`meshnet.cli.server` uses of a
    :class:`Drain` (``run``, ``cut``, ``in_flight``, ``draining``).
    """

    def __init__(self, *drains: Drain) -> None:
        if not drains:
            raise ValueError("a drain group needs at least one drain")
        self.drains = drains
        self.cut = drains[0].cut
        for drain in drains:
            drain.cut = self.cut

    @property
    def draining(self) -> bool:
        return any(d.draining for d in self.drains)

    @property
    def in_flight(self) -> int:
        return sum(d.in_flight for d in self.drains)

    async def run(self) -> bool:
        """Drain every member concurrently; True when none had to cut anything."""
        results = await asyncio.gather(*(d.run() for d in self.drains))
        return all(results)


#: the scope key under which :class:`DrainMiddleware` keeps what a tracked response is (see
#: :class:`EventStream`)
RESPONSE_STATE = "meshnet.drain.response"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that a drain can end with an error event.

    Calling it marks the request's state in the scope (:data:`RESPONSE_STATE`, set by
    :class:`DrainMiddleware`) as a started event stream, once, before Starlette sends the response
    start; nothing of meshnet runs per event after that (the middleware does not wrap ``send``).
    ``media_type`` is ``text/event-stream`` unless ``headers`` name another content type.
    """

    media_type = "text/event-stream"

    def __call__(self, scope, receive, send):
        state = scope.get(RESPONSE_STATE)
        if state is not None:
            state["event_stream"] = True
        return super().__call__(scope, receive, send)


class DrainMiddleware:
    """ASGI middleware: requests to ``paths`` are work that a drain waits for.

    While draining, a new such request is a 503 ``draining``. One in flight counts in
    ``drain.in_flight`` until the app has finished with it. If ``drain.cut`` is set first, the
    request is cancelled: an event stream (:class:`EventStream`) ends with an SSE error event (code
    ``draining``) and a proper end of body; a response not started yet becomes the 503; any other
    started response gets its end of body. Likewise an exception after an event stream started (a
    bug, a torch error) ends it with an ``internal_error`` event instead of a silently dropped
    connection. The app runs in a task of its own with the server's ``send`` (no wrapper: no
    frame of this middleware runs per event); a message the server refuses because the response
    had already started or ended is how the middleware learns it, as ASGI servers must refuse them.

    Args:
        app: the ASGI app; ``drain``: the process's :class:`Drain`; ``paths``: exact paths, as the
            app routes them (a mounted app's paths below its mount point).
    """

    def __init__(self, app, drain: Drain, paths: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")) -> None:
        self.app, self.drain, self.paths = app, drain, frozenset(paths)

    def __call__(self, scope, receive, send):
        """Other requests and WebSockets go straight to the app (returned, not awaited: no frame of
        this middleware stays on their stack); chats are tracked by :meth:`_tracked`."""
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            return self.app(scope, receive, send)
        return self._tracked(scope, receive, send)

    async def _tracked(self, scope, receive, send) -> None:
        drain = self.drain
        try:
            drain.refuse_new("new chats")
        except Draining as exc:
            await _send_error(send, exc)
            return
        state = scope[RESPONSE_STATE] = {"event_stream": False}
        drain.in_flight += 1
        try:
            task = asyncio.ensure_future(self.app(scope, receive, send))
            cut = asyncio.ensure_future(drain.cut.wait())
            try:
                await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                cut.cancel()
            if task.done():
                if task.cancelled() or task.exception() is None or not state["event_stream"]:
                    task.result()  # a response not started yet: the server's own 500
                    return
                log.error("chat failed mid-response", exc_info=task.exception())
                await _end_stream(send, state, MeshnetError("the generation failed: "
                                                            f"{type(task.exception()).__name__}"))
                return
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            if asyncio.current_task().cancelling():
                raise asyncio.CancelledError
            await _end_stream(send, state, Draining(
                "the service stopped before this generation finished (drain grace ran out)",
                hint="send the request again: another node will serve it"))
        finally:
            drain.in_flight -= 1


#: the last message of every response body
_END = {"type": "http.response.body", "body": b"", "more_body": False}


async def _end_stream(send, state: dict, exc: MeshnetError) -> None:
    """End a cut or failed response: an event stream with ``exc`` as its last event; a response not
    started yet as ``exc``'s JSON error; any other started response with its end of body. The server
    refuses what no longer fits (the response had started, or ended): the next way is tried."""
    ends = [[{"type": "http.response.body", "body": sse_error(exc), "more_body": True}]] if state["event_stream"] else []
    ends += [_error_messages(exc), []]
    for messages in ends:
        try:
            for message in [*messages, _END]:
                await send(message)
            return
        except Exception as refused:  # noqa: BLE001 - an ASGI server refuses out-of-order messages
            log.debug("the server refused a drain's ending (%s); trying the next", refused)


def _error_messages(exc: MeshnetError) -> list[dict]:
    """``exc``'s JSON error response as ASGI messages, less its end of body."""
    body = json.dumps(exc.to_envelope()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if getattr(exc, "retry_after_s", None) is not None:
        headers.append((b"retry-after", str(exc.retry_after_s).encode()))
    return [{"type": "http.response.start", "status": exc.status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": True}]


async def _send_error(send, exc: Draining) -> None:
    for message in [*_error_messages(exc), _END]:
        await send(message)
