"""The tracker's chat proxy: which entry node gets a chat, and relaying its answer (ADR-0031).

A new chat must not see an entry node's absence while another entry is up: one that
cannot be reached (SIGKILLed, still starting) or that answers 503 ``draining`` is skipped
for the next. A stream whose entry connection breaks ends with an SSE error event rather
than stopping mid-event.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import httpx

from meshnet.drain import sse_error
from meshnet.errors import Draining, MeshnetError
from meshnet.tracker.service import TrackerService

log = logging.getLogger(__name__)

#: entry nodes one chat tries (each unreachable or draining one is skipped for the next)
ENTRY_ATTEMPTS = 3


async def open_entry(svc: TrackerService, http: httpx.AsyncClient, model: str,
                     body: bytes) -> tuple[httpx.Response, str]:
    """Send a chat to an entry node (counting it as served once one is chosen), trying up to
    ``ENTRY_ATTEMPTS`` of them: one that cannot be reached is reported (later chats choose it
    last for a while), one that answers 503 ``draining`` is marked draining.

    Returns:
        ``(response with its body still streaming, entry node id)``.

    Raises:
        ModelNotRoutable: no entry node (503 ``model_loading``).
        MeshnetError: 502 ``entry_unreachable``: no entry node answered.
    """
    tried: set[str] = set()
    failure: MeshnetError | None = None
    while len(tried) < ENTRY_ATTEMPTS:
        try:
            node = svc.entry_node(model, frozenset(tried))
        except MeshnetError as exc:
            if failure is not None and exc.code == "entry_unreachable":
                raise failure from None
            raise
        if not tried:
            svc.metrics.requests.labels(model=model).inc()
            svc.add_served(model)
        upstream = http.build_request("POST", f"{node.endpoint}/v1/chat/completions", content=body,
                                      headers={"Content-Type": "application/json"})
        try:
            resp = await http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            svc.report_failure(node.node_id, str(exc))
            failure = MeshnetError(f"entry node {node.node_id} unreachable: {exc}", code="entry_unreachable",
                                   status=502)
        else:
            if resp.status_code != 503 or not await _says_draining(resp):
                return resp, node.node_id
            if node.node_id in svc.nodes:
                svc.drain(node.node_id)
            failure = MeshnetError(f"entry node {node.node_id} is draining", code="entry_unreachable", status=502)
        tried.add(node.node_id)
        log.warning("%s; trying another entry node", failure.message)
    raise failure


async def _says_draining(resp: httpx.Response) -> bool:
    """Read a 503 answer (and close it): is it a node's ``draining`` refusal?"""
    try:
        await resp.aread()
        return resp.json().get("error", {}).get("code") == Draining.code
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    finally:
        await resp.aclose()


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
