"""One error hierarchy for meshnet.

Every error carries a human ``message``, an optional ``hint`` (what to do about it),
a machine ``code`` and the HTTP ``status`` it maps to at the service edge. The CLI
prints ``message`` and ``hint`` to stderr and exits non-zero; HTTP handlers turn it
into the OpenAI-style envelope ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations


class MeshnetError(Exception):
    """Base error. ``status`` is the HTTP status used at the service edge."""

    status: int = 500
    code: str = "internal_error"
    type: str = "server_error"

    def __init__(self, message: str, *, hint: str | None = None, code: str | None = None,
                 status: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.param = param  # the request field at fault (OpenAI's ``error.param``), if any
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_envelope(self) -> dict:
        """OpenAI-compatible error body: ``{"error": {"message", "type", "code"}}``, plus
        ``param`` (the field at fault) and ``hint`` when known."""
        body = {"message": self.message, "type": self.type, "code": self.code}
        if self.param is not None:
            body["param"] = self.param
        if self.hint:
            body["hint"] = self.hint
        return {"error": body}


class InvalidRequest(MeshnetError):
    """Malformed input from a client (HTTP 400/422)."""

    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class WireError(InvalidRequest):
    """A binary activation frame that fails validation (see meshnet.node.wire)."""

    code = "invalid_activation"


class PayloadTooLarge(WireError):
    """A frame whose (decompressed) size exceeds the configured limit (HTTP 413)."""

    status = 413
    code = "payload_too_large"


class RequestTimeout(MeshnetError):
    """A request whose body did not arrive within the time allowed (HTTP 408)."""

    status = 408
    code = "request_timeout"


class NotFound(MeshnetError):
    status = 404
    code = "not_found"
    type = "invalid_request_error"


class Unavailable(MeshnetError):
    """The service is healthy but takes no such work now (HTTP 503); the caller goes elsewhere or retries."""

    status = 503
    code = "unavailable"
    type = "service_unavailable"


class ModelNotRoutable(Unavailable):
    """The model has a coverage gap; callers get 503 ``model_loading`` and should retry."""

    code = "model_loading"

    def __init__(self, message: str, *, coverage: dict | None = None, retry_after_s: int = 5,
                 **kw) -> None:
        super().__init__(message, **kw)
        self.coverage = coverage
        self.retry_after_s = retry_after_s

    def to_envelope(self) -> dict:
        body = super().to_envelope()
        if self.coverage is not None:
            body["coverage"] = self.coverage
        return body


class HopFailed(MeshnetError):
    """A remote hop (node) failed or timed out during a forward call."""

    status = 502
    code = "hop_failed"

    def __init__(self, message: str, *, node_id: str | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.node_id = node_id


class HopBusy(HopFailed):
    """A hop refused new work but is healthy (it answered 503, e.g. ``session_cache_full`` or a
    drain): try another holder of its layers, and do not report it as failed (HTTP 503)."""

    status = 503
    code = "hop_busy"
    type = "service_unavailable"


class ModelSourceError(MeshnetError):
    """A model's weights could not be found, fetched or converted."""

    code = "model_source_error"


class Unauthorized(MeshnetError):
    """The caller did not prove who it is: a token or a signature missing, wrong or stale (HTTP 401)."""

    status = 401
    code = "unauthorized"
    type = "authentication_error"


class Forbidden(MeshnetError):
    """The caller is known but may not do this (HTTP 403)."""

    status = 403
    code = "forbidden"
    type = "permission_error"


class Conflict(MeshnetError):
    """The request contradicts state the service keeps, e.g. a node id bound to another key (HTTP 409)."""

    status = 409
    code = "conflict"
    type = "invalid_request_error"


class TicketExpired(Unauthorized):
    """A session ticket ran out (HTTP 401 ``ticket_expired``, ADR-0038): the entry asks the tracker
    for a new route and ticket and replays; the hop that said so is healthy."""

    code = "ticket_expired"


class SessionConflict(Conflict):
    """A position does not continue the session a hop holds: expired, released, ended by its entry
    or out of order (HTTP 409 ``session_conflict``, ADR-0031). The hop is healthy; the entry
    replays the session there or elsewhere."""

    code = "session_conflict"


#: codes of a hop error after which the hop stays eligible: it is healthy, it lost the session or
#: its ticket ran out, and a replay with a fresh route and ticket restarts the session there
HEALTHY_HOP_CODES = frozenset({SessionConflict.code, TicketExpired.code})


class Draining(Unavailable):
    """The service is draining before it exits: it takes no new work (HTTP 503 ``draining``).

    A caller should go elsewhere at once (the tracker's proxy tries another entry node; an
    entry node fails the hop over to another holder of the layers)."""

    code = "draining"
    retry_after_s = 1
