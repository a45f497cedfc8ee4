"""The HTTP edge every meshnet service shares: the error envelope, JSON body validation and
the request body size limit (torch-free).

- :func:`error_response`: the one mapping of a :class:`meshnet.errors.MeshnetError` to a response.
- :func:`validate_json`: a JSON body into a pydantic model, a 4xx naming the bad field.
- :class:`BodyLimit`: ASGI middleware. A body over the limit is refused with 413 ``payload_too_large`` in the JSON error envelope:
at once when ``Content-Length`` announces it, else as soon as the bytes received pass the
limit (chunked uploads), so a huge body is never buffered nor parsed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.errors import InvalidRequest, MeshnetError, PayloadTooLarge, RequestTimeout

def route_path(scope: Scope) -> str:
    """The request path an app routes on: ``scope["path"]`` less the ``root_path`` of the mounts
    above it (``/v1/forward`` for a node app mounted at ``/node`` and called at ``/node/v1/forward``)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def same_secret(given: str, secret: str) -> bool:
    """Whether a header's value ``given`` is ``secret`` (a token), in constant time. Compared as
    bytes: the header's as sent (Starlette decodes header values as latin-1) against the secret's
    UTF-8; a ``str`` comparison raises on non-ASCII text, a 500 where a wrong token is a 401."""
    return hmac.compare_digest(given.encode("latin-1"), secret.encode("utf-8"))


def error_response(exc: MeshnetError) -> JSONResponse:
    """The one mapping of a :class:`MeshnetError` to an HTTP response."""
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return JSONResponse(exc.to_envelope(), status_code=exc.status, headers=headers)


def sse_error(exc: MeshnetError) -> bytes:
    """One server-sent event carrying the OpenAI error envelope of ``exc`` (an error after a stream started)."""
    return f"data: {json.dumps(exc.to_envelope())}\n\n".encode()


async def http_error(request, exc) -> JSONResponse:
    """Starlette's own HTTP errors (unknown path 404, wrong method 405) in the JSON envelope."""
    status = getattr(exc, "status_code", 500)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
    what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(InvalidRequest(what.get(status, str(getattr(exc, "detail", "") or status)), code=kind,
                                         status=status, hint="see the service's routes in its module docstring"
                                         if status == 404 else None))


def validate_json(model: type[BaseModel], body: bytes, *, status: int = 422, unknown_is_unsupported: bool = False):
    """Parse and validate a JSON body into ``model``.

    Raises:
        InvalidRequest: not JSON (400); a field fails validation (``status``, default 422,
            code ``invalid_field``; an unknown field too, unless ``unknown_is_unsupported``), or is
            one meshnet refuses (400 ``unsupported_parameter``, the OpenAI surface's unknown
            fields with ``unknown_is_unsupported``); the message and ``error.param`` name the field.
    """
    try:
        data = json.loads(body or b"{}")
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "extra_forbidden" and not unknown_is_unsupported:
            raise InvalidRequest(f"invalid field '{field}': unknown field", code="invalid_field", status=status,
                                 param=field) from exc
        if err["type"] in ("extra_forbidden", "unsupported"):
            why = err["msg"] if err["type"] == "unsupported" else "not a chat parameter meshnet knows"
            raise InvalidRequest(f"unsupported parameter '{field}': {why}", code="unsupported_parameter",
                                 param=field) from exc
        msg = err["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"invalid field '{field}': {msg}", code="invalid_field", status=status,
                             param=field) from exc


#: default limit of JSON bodies, bytes. The biggest is a chat request: a prompt filling a
#: 128k-token context is about 0.5 MB of text (about 4 characters per token), and even at
#: JSON's worst escaping (6 bytes per character) about 3 MB; 8 MiB leaves room for that while
#: bounding what one request makes a service read and parse.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is {size} bytes or more; the limit is {limit} bytes",
                           hint="send a smaller body (a shorter prompt), or raise --max-body-bytes")


#: seconds a request's whole body may take to arrive: a body that trickles in is cut with a 408
#: instead of holding its connection open for ever (a few MB of hop frame take far less)
DEFAULT_BODY_TIMEOUT_S = 30.0


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` or slower than ``body_timeout_s``
    seconds in all (408) (``path_limits`` overrides the
    limit of exact paths, e.g. the node's binary ``/v1/forward`` frames; ``prefix_limits`` that of
    every path under a prefix, e.g. ``/v1/relay/``, whose handler enforces its own limit; paths as
    the app routes them, :func:`route_path`, so a mounted app keeps its limits)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 path_limits: dict[str, int] | None = None, prefix_limits: dict[str, int] | None = None,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.path_limits = app, max_bytes, dict(path_limits or {})
        self.prefix_limits, self.body_timeout_s = dict(prefix_limits or {}), body_timeout_s

    def limit(self, path: str) -> int:
        """The body limit of ``path``, bytes: its exact entry, else its prefix's, else ``max_bytes``."""
        if path in self.path_limits:
            return self.path_limits[path]
        return next((v for k, v in self.prefix_limits.items() if path.startswith(k)), self.max_bytes)

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The app's call with a limited ``receive``, returned rather than awaited: no frame of this
        middleware stays on a request's stack, so a long stream (SSE, a hop's WebSocket) never
        re-enters it."""
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        limit = self.limit(route_path(scope))
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return error_response(_too_large(int(declared), limit))(scope, receive, send)
        received, complete, deadline = 0, False, time.monotonic() + self.body_timeout_s

        async def limited() -> Message:
            nonlocal received, complete
            if complete:  # the body is in: what follows is the wait for a disconnect, with no deadline
                return await receive()
            try:
                # not wait_for: on Python 3.11 it can swallow a cancel
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except asyncio.TimeoutError:
                raise RequestTimeout(f"the request body took over {self.body_timeout_s:g} s to arrive "
                                     f"({received} bytes so far)", hint="send the whole body at once") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > limit:
                    raise _too_large(received, limit)  # rendered by the app's MeshnetError handler
            return message

        return self.app(scope, limited, send)
