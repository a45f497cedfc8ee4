"""Request body size limit for the tracker and node apps (ASGI middleware, torch-free).

A body over the limit is refused with 413 ``payload_too_large`` in the JSON error envelope:
at once when ``Content-Length`` announces it, else as soon as the bytes received pass the
limit (chunked uploads), so a huge body is never buffered nor parsed.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.errors import PayloadTooLarge
from meshnet.gateway.schema import error_response

#: default limit of JSON bodies, bytes. The biggest is a chat request: a prompt filling a
#: 128k-token context is about 0.5 MB of text (about 4 characters per token), and even at
#: JSON's worst escaping (6 bytes per character) about 3 MB; 8 MiB leaves room for that while
#: bounding what one request makes a service read and parse.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is {size} bytes or more; the limit is {limit} bytes",
                           hint="send a smaller body (a shorter prompt), or raise --max-body-bytes")


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` (``path_limits`` overrides the
    limit of exact paths, e.g. the node's binary ``/v1/forward`` frames)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 path_limits: dict[str, int] | None = None) -> None:
        self.app, self.max_bytes, self.path_limits = app, max_bytes, dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await error_response(_too_large(int(declared), limit))(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(received, limit)  # rendered by the app's MeshnetError handler
            return message

        await self.app(scope, limited, send)
