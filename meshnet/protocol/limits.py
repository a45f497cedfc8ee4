"""Per-client limits on generation requests (ADR-0060).

One client holding every session of a network's entry nodes keeps everyone else out
(``session_cache_full``). :class:`ClientLimit` lets each client have at most ``max_requests``
chat or completion requests in flight at once (a streamed one counts until its stream ends); the
next gets a 429 ``too_many_requests`` that says how many it holds. The tracker applies it to the
chats it proxies, entry nodes to the ones they are sent directly.

A client is its bearer key when it sends one (``Authorization: Bearer <key>``: an operator may
hand out one key per user), else the address it connects from. Not counted: loopback clients
(the operator's own host, and a relayed node's tunnel, which replays calls from 127.0.0.1),
in-process calls (no address), and whatever the app's ``exempt`` says (an entry node exempts
the chats its tracker proxies, which the tracker has counted already).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from meshnet.errors import MeshnetError
from meshnet.protocol.http import error_response, route_path

#: generation requests in flight per client by default: a small part of what an entry node holds at
#: once, so one client cannot fill it, and enough for an agent or a harness running a few side by
#: side (ADR-0060)
DEFAULT_MAX_CLIENT_REQUESTS = 4
#: the paths that start generations (the OpenAI surface of trackers and entry nodes)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class TooManyRequests(MeshnetError):
    """A client already has as many generation requests in flight as it may (HTTP 429)."""

    status = 429
    code = "too_many_requests"
    type = "rate_limit_error"
    retry_after_s = 1


def client_of(scope: Scope) -> str | None:
    """Who sent the request: ``key:<sha256 of the bearer key, 16 hex>`` or ``addr:<address>``;
    None for a loopback or in-process caller (not counted)."""
    headers = dict(scope.get("headers") or ())
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer " and auth[7:].strip():
        return "key:" + hashlib.sha256(auth[7:].strip()).hexdigest()[:16]
    client = scope.get("client")
    if not client or not client[0]:
        return None
    try:
        if ipaddress.ip_address(client[0].split("%")[0]).is_loopback:
            return None
    except ValueError:
        pass  # a name (a test client, a Unix socket): counted as it is
    return "addr:" + client[0]


class ClientLimit:
    """ASGI middleware: at most ``max_requests`` requests to ``paths`` in flight per client
    (:func:`client_of`); the next one is a 429 ``too_many_requests``. ``max_requests`` 0: no limit.
    ``exempt(scope)``: requests not counted (and not limited)."""

    def __init__(self, app: ASGIApp, max_requests: int = DEFAULT_MAX_CLIENT_REQUESTS,
                 paths: frozenset[str] = GENERATION_PATHS, exempt: Callable[[Scope], bool] | None = None) -> None:
        self.app, self.max_requests, self.paths, self.exempt = app, max_requests, paths, exempt
        self.in_flight: dict[str, int] = {}

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The app's call, returned rather than awaited for every request not counted (a hop's
        stream, a loopback chat), so no frame of this middleware stays on their stacks and a long
        stream never re-enters it (as :class:`meshnet.protocol.http.BodyLimit`)."""
        client = None
        if scope["type"] == "http" and self.max_requests > 0 and route_path(scope) in self.paths:
            client = client_of(scope)
            if client is not None and self.exempt is not None and self.exempt(scope):
                client = None
        return self.app(scope, receive, send) if client is None else self._counted(client, scope, receive, send)

    async def _counted(self, client: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a request over the client's limit (429), else serve it counted; the count is
        taken when the request starts and released when the app is done with it."""
        held = self.in_flight.get(client, 0)
        if held >= self.max_requests:
            who = "this key" if client.startswith("key:") else f"address {client[5:]}"
            exc = TooManyRequests(f"{who} has {held} generation requests in flight; at most {self.max_requests} at "
                                  f"once per client", hint="wait for one to finish (or ask the operator for a key "
                                                           "of your own)")
            await error_response(exc)(scope, receive, send)
            return
        self.in_flight[client] = held + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[client] - 1
            if left:
                self.in_flight[client] = left
            else:
                del self.in_flight[client]
