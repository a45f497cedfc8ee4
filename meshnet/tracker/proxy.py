"""The tracker's chat proxy: which entry node gets a chat, and relaying its answer (ADR-0032).

A new chat must not see an entry node's absence while another entry is up. The entry nodes
are tried in the tracker's order (:meth:`TrackerService.entry_nodes`), at most
:data:`ENTRY_TRIES` of them: one that cannot be reached (SIGKILLed, still starting, a bad
URL) is reported and probed, one that answers 503 ``draining`` is marked draining, one that
answers 503 ``session_cache_full`` has no room; each time the next one is tried. A stream
whose entry connection breaks ends with an SSE error event rather than stopping mid-event.

A proxied chat has a connect timeout but no read timeout: a non-streamed generation sends nothing
until it is over, and a slow entry that is still generating has not failed (its own hop deadlines
catch a frozen hop). The client decides how long to wait: while the entry's answer has not begun,
the proxy watches the client, and when it hangs up the upstream request is cancelled, which the
entry sees as its own client's disconnect and stops the generation (ADR-0049).

A tracker that serves the first layers itself (ADR-0044) holds an entry node in its own
process (:class:`LocalNode`): a chat it can serve goes to that node's app in-process
(:class:`LocalChat`), with no network hop, and only to the remote entries when the local one
refuses it (draining, out of session room).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.protocol.http import sse_error
from meshnet.drain import EventStream
from meshnet.errors import Draining, MeshnetError
from meshnet.tracker.registry import NodeRecord
from meshnet.tracker.service import TrackerService

log = logging.getLogger(__name__)

#: entry nodes one chat may try
ENTRY_TRIES = 3
#: 503 codes of an entry node after which the next entry node is tried
NEXT_ENTRY_CODES = frozenset({Draining.code, "session_cache_full"})
#: seconds to connect to an entry node; reading its answer has no limit (see the module docstring)
CONNECT_TIMEOUT_S = 5.0
#: how often the client is checked for a hang-up while the entry's answer has not begun, seconds
DISCONNECT_POLL_S = 0.25
#: the status logged for a chat whose client left before its answer began (nobody receives it)
CLIENT_CLOSED = 499

Disconnected = Callable[[], Awaitable[bool]]


async def send_watching(http: httpx.AsyncClient, upstream: httpx.Request,
                        disconnected: Disconnected | None) -> httpx.Response | None:
    """``http.send(upstream, stream=True)``, cancelled when ``disconnected()`` turns true (checked
    every :data:`DISCONNECT_POLL_S`) before the answer's headers arrive; None then.

    Raises:
        whatever ``http.send`` raises.
    """
    sending = asyncio.ensure_future(http.send(upstream, stream=True))
    try:
        while disconnected is not None:
            done, _ = await asyncio.wait({sending}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await disconnected():
                sending.cancel()
                with contextlib.suppress(BaseException):
                    await sending
                return None
        return await sending
    finally:
        if not sending.done():  # this call was cancelled itself
            sending.cancel()


async def forward_chat(svc: TrackerService, http: httpx.AsyncClient, entries: list[NodeRecord], body: bytes,
                       on_unreachable: Callable[[NodeRecord], None],
                       disconnected: Disconnected | None = None, path: str = "/v1/chat/completions") -> Response:
    """Send a chat (or text completion: ``path``) body to the first entry node of ``entries`` that
    takes it; its answer, streamed.

    ``on_unreachable(node)`` runs for each entry node that could not be reached (the app probes it).
    The last entry node's answer is returned whatever it is. ``disconnected()`` tells whether the
    client hung up: the entry's request is then cancelled (:func:`send_watching`) and an empty
    :data:`CLIENT_CLOSED` answer returned.

    Raises:
        MeshnetError: 502 ``entry_unreachable`` when the last entry node tried could not be reached.
    """
    failure: MeshnetError | None = None
    for i, node in enumerate(entries):
        last = i + 1 == len(entries)
        url = f"{node.endpoint}{path}"
        # signed: the entry does not count a proxied chat against the tracker's address (ADR-0060)
        headers = {"Content-Type": "application/json", **svc.tickets.sign_call("POST", url)}
        try:
            upstream = http.build_request("POST", url, content=body, headers=headers,
                                          timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
            resp = await send_watching(http, upstream, disconnected)
            if resp is None:
                log.info("the client of a chat proxied to %s hung up; its generation was cancelled", node.node_id)
                return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:  # noqa: BLE001 - refused, timed out, bad URL...: the entry node failed
            svc.report_failure(node.node_id, str(exc))
            on_unreachable(node)
            failure = MeshnetError(f"entry node {node.node_id} at {node.endpoint} unreachable: "
                                   f"{type(exc).__name__}: {exc}", code="entry_unreachable", status=502)
            log.warning("%s%s", failure.message, "" if last else "; trying the next entry node")
            continue
        if resp.status_code == 503 and not last:
            answer = await resp.aread()
            await resp.aclose()
            code = _error_code(answer)
            if code in NEXT_ENTRY_CODES:
                if code == Draining.code and node.node_id in svc.nodes:
                    svc.drain(node.node_id)  # it says so itself: no more routes through it either
                log.info("entry node %s answered %s; trying %s", node.node_id, code, entries[i + 1].node_id)
                continue
            return Response(answer, status_code=503, media_type=resp.headers.get("content-type"))
        headers = {k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "cache-control")}
        event_stream = resp.headers.get("content-type", "").startswith("text/event-stream")
        response = EventStream if event_stream else StreamingResponse  # a drain ends an event stream with an event
        return response(relay(svc, resp, node.node_id, event_stream), status_code=resp.status_code,
                        headers=headers, background=BackgroundTask(resp.aclose))
    raise failure


def _error_code(answer: bytes) -> str | None:
    try:
        return json.loads(answer)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def relay(svc: TrackerService, resp: httpx.Response, node_id: str, event_stream: bool) -> AsyncIterator[bytes]:
    """The entry's body, passed through. If the entry's connection breaks mid-body, an event
    stream ends with an SSE error event (code ``entry_unreachable``) instead of silently."""
    tail = b"\n\n"
    try:
        async for chunk in resp.aiter_raw():
            if chunk:
                tail = chunk[-2:]
            yield chunk
    except httpx.HTTPError as exc:
        svc.report_failure(node_id, f"stream cut: {exc}")
        log.warning("entry node %s cut a proxied stream: %s", node_id, exc)
        if event_stream:
            error = MeshnetError(f"entry node {node_id} stopped mid-generation: {type(exc).__name__}",
                                 code="entry_unreachable", status=502, hint="send the request again")
            yield (b"" if tail == b"\n\n" else b"\n\n") + sse_error(error)


@dataclass(frozen=True)
class LocalNode:
    """The node this tracker's process also runs (ADR-0044): its id as registered, and its ASGI
    app (mounted at ``/node`` by the composition, :mod:`meshnet.trackernode`)."""

    node_id: str
    app: ASGIApp


#: what the entry's chat and text completion endpoints are called at inside its own app
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class LocalChat:
    """ASGI response: a chat answered by the in-process entry node (:class:`LocalNode`).

    The node's app gets the request as if it had been sent to its own ``/v1/chat/completions``
    (its middleware, drain count and error envelope included), the already-read ``body`` first,
    then the client's own messages (a disconnect reaches the generation). When the node
    answers 503 with a code of :data:`NEXT_ENTRY_CODES` and ``fallback`` is given, that answer
    is dropped and ``fallback()``'s response (the remote entries, :func:`forward_chat`) is sent
    instead.
    """

    def __init__(self, node: LocalNode, body: bytes,
                 fallback: Callable[[], Awaitable[Response]] | None = None, path: str = CHAT_PATH) -> None:
        self.node, self.body, self.fallback, self.path = node, body, fallback, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        inner = {k: v for k, v in scope.items() if k not in ("app", "router", "endpoint", "path_params")}
        inner.update(path=self.path, raw_path=self.path.encode(), root_path="")
        body_sent = False

        async def replay() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            return await receive()

        held: list[Message] = []

        async def hold_refusal(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503 and self.fallback:
                held.append(message)
            elif held:
                held.append(message)
            else:
                await send(message)

        await self.node.app(inner, replay, hold_refusal)
        if not held:
            return
        answer = b"".join(m.get("body", b"") for m in held[1:])
        code = _error_code(answer)
        if code in NEXT_ENTRY_CODES:
            log.info("the tracker's own entry node %s answered %s; trying the remote entry nodes",
                     self.node.node_id, code)
            response = await self.fallback()
            await response(scope, receive, send)
            return
        for message in held:
            await send(message)
