"""Typed httpx clients of the tracker and node HTTP APIs (used by the CLI, nodes and the TUI).

Imports neither torch nor textual. Every failure becomes a :class:`MeshnetError` whose
message says what was asked of whom.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ValidationError

from meshnet.endpoints import check_endpoints
from meshnet.errors import MeshnetError, ModelNotRoutable
from meshnet.protocol.control import (AssignResponse, DirectiveList, FailureReport, HeartbeatRequest,
                                      HeartbeatResponse, RegisterRequest, RegisterResponse, AuditReport)
from meshnet.protocol.route import Hop, Route, RouteResponse
from meshnet.protocol.traffic import MeshTraffic
from meshnet.protocol.views import Coverage, CoverageList, DemandList, NodeList
from meshnet.protocol.signing import HEADER_JOIN_TOKEN, sign_request

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)


def error_from_response(resp: httpx.Response, what: str | None = None) -> MeshnetError:
    """The error an HTTP error answer carries, never raising itself: the envelope's message, code and
    hint (``ModelNotRoutable`` with the coverage for ``model_loading``), else the first line of
    whatever text came back. ``what`` (the call, e.g. "register node") prefixes the message."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    message = err.get("message")
    if message is None:
        text = (resp.text.strip().splitlines() or [""])[0][:300]
        message = f"HTTP {resp.status_code}: {text or resp.reason_phrase}"
    elif what:
        message = f"HTTP {resp.status_code}: {message}"
    message = f"{what}: {message}" if what else str(message)
    if err.get("code") == "model_loading":
        return ModelNotRoutable(message, coverage=body.get("coverage"),
                                retry_after_s=int(resp.headers.get("Retry-After", "5")))
    return MeshnetError(message, code=str(err.get("code") or "http_error"), status=resp.status_code,
                        hint=err.get("hint"))


def _raise_for(resp: httpx.Response, what: str) -> None:
    if resp.status_code >= 400:
        raise error_from_response(resp, what)


def _database_unreachable(resp: httpx.Response) -> bool:
    """Whether ``resp`` is a tracker's 503 ``database_unreachable`` (another tracker of the same
    network may still answer: a client of several tries it, ADR-0054)."""
    if resp.status_code != 503:
        return False
    try:
        return resp.json()["error"]["code"] == "database_unreachable"
    except (ValueError, KeyError, TypeError):
        return False


#: seconds to connect before a call fails as unreachable (the whole call may take ``timeout_s``)
CONNECT_TIMEOUT_S = 5.0
#: seconds a client of several equal services (every tracker of one database) waits for an
#: answer to a call that is safe to send again (reads, heartbeats, registrations) before it takes
#: that one as hung and sends the call to the next (ADR-0054): a process frozen by the OS or a
#: debugger still accepts connections, so only a deadline tells it from a slow one
ANSWER_DEADLINE_S = 3.0


def _parse(model: type[T], body: Any, what: str) -> T:
    """Validate a response body into ``model``.

    Raises:
        MeshnetError: the body does not match (``bad_response``, 502), naming the first bad field.
    """
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise MeshnetError(f"{what}: unexpected answer, field '{field}': {err['msg']}", code="bad_response",
                           status=502, hint="tracker and node versions may differ") from exc


#: seconds the tracker may take over an audit's dispute (it re-runs the steps on two holders)
AUDIT_TIMEOUT_S = 300.0


class NodeSigner(httpx.Auth):
    """httpx auth that signs every request as node ``node_id`` with its key (ADR-0035,
    :func:`meshnet.protocol.signing.sign_request`)."""

    requires_request_body = True

    def __init__(self, node_id: str, key: Ed25519PrivateKey) -> None:
        self.node_id, self.key = node_id, key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        query = request.url.query.decode()
        target = request.url.path + (f"?{query}" if query else "")
        request.headers.update(sign_request(self.key, self.node_id, request.method, target, request.content))
        yield request


class _Base:
    """A client of one service, or of several equal ones (every tracker of one database, ADR-0043).

    ``url``: a base URL, several separated by commas, or a list of them. Calls go to the one that
    answered last (:attr:`url`, the first at the start). When it cannot be connected to, the call
    goes to the next at once (nothing was sent). A call that is safe to send again (``GET``, or
    ``retry=True``: heartbeats, registrations, reports) waits at most :attr:`answer_deadline_s`
    for an answer when there are several URLs, then goes to the next (as it does on a 503
    ``database_unreachable``); any other call that fails
    later (a timeout, a dropped connection) fails, since it may have been carried out, and the
    next call goes to the next URL. ``token``: the operator's bearer token; ``auth``: httpx auth
    applied to every call (a node passes its :class:`NodeSigner`).

    Raises:
        InvalidRequest (``invalid_endpoint``): a URL is not a usable base URL.
    """

    def __init__(self, url: str | Sequence[str], *, token: str | None = None, timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None, auth: httpx.Auth | None = None) -> None:
        self.urls = check_endpoints(url)
        self.url = self.urls[0]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout, transport=transport, auth=auth)
        self.answer_deadline_s = ANSWER_DEADLINE_S

    async def _request(self, method: str, path: str, what: str, *, retry: bool | None = None,
                       **kw) -> httpx.Response:
        """Send to :attr:`url`, moving on to the next URL as the class says (``retry``: the call
        may be sent again; default: only a ``GET``).

        Raises:
            MeshnetError (503 ``unreachable``): no URL could be reached, or the call failed midway.
        """
        start = self.urls.index(self.url)
        order = self.urls[start:] + self.urls[:start]
        resend = (method == "GET" if retry is None else retry) and len(order) > 1
        if resend:
            kw.setdefault("timeout", self.answer_deadline_s)
        for i, url in enumerate(order):
            try:
                resp = await self.http.request(method, url + path, **kw)
            except httpx.ConnectError as exc:
                if i + 1 < len(order):
                    continue
                raise MeshnetError(f"{what}: cannot reach {self._names(url)}: {type(exc).__name__}: {exc}",
                                   code="unreachable", status=503,
                                   hint="is the service running? check --url / --tracker") from exc
            except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
                if resend and isinstance(exc, httpx.TimeoutException) and i + 1 < len(order):
                    log.warning("%s did not answer %s within %.1f s; trying %s", url, what, kw["timeout"], order[i + 1])
                    continue
                self.url = order[(i + 1) % len(order)]  # the next call tries another one
                raise MeshnetError(f"{what}: cannot reach {url}: {type(exc).__name__}: {exc}",
                                   code="unreachable", status=503,
                                   hint="is the service running? check --url / --tracker") from exc
            if resend and i + 1 < len(order) and _database_unreachable(resp):
                log.warning("%s cannot reach its database for %s; trying %s", url, what, order[i + 1])
                continue
            if url != self.url:
                log.warning("%s did not answer; %s did, and takes the calls from now on", self.url, url)
                self.url = url
            return resp
        raise AssertionError("unreachable: the loop returns or raises")

    def _names(self, last: str) -> str:
        return last if len(self.urls) == 1 else f"any of {', '.join(self.urls)}"

    async def _call(self, method: str, path: str, what: str, **kw) -> Any:
        resp = await self._request(method, path, what, **kw)
        _raise_for(resp, what)
        try:
            return resp.json() if resp.content else None
        except ValueError as exc:
            raise MeshnetError(f"{what}: {self.url} answered {resp.status_code} with a body that is not JSON",
                               code="bad_answer", status=502) from exc

    async def _ready(self, what: str, **kw) -> dict:
        """``GET /v1/ready``: the body whether ready (200) or not (503, with ``reasons``)."""
        resp = await self._request("GET", "/v1/ready", what, **kw)
        if resp.status_code == 503:
            try:
                body = resp.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and "ready" in body:
                return body
        _raise_for(resp, what)
        return resp.json()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class TrackerClient(_Base):
    """Client of the tracker API (``/v1/...``).

    A node's client is built with ``auth=NodeSigner(...)`` (its calls are signed) and the
    tracker's ``join_token`` (sent with registrations)."""

    def __init__(self, url: str, *, join_token: str | None = None, **kw) -> None:
        super().__init__(url, **kw)
        self.join_token = join_token

    async def register(self, payload: RegisterRequest) -> RegisterResponse:
        """Register a node (signed by the client's auth; the join token when the client has one).

        Raises:
            MeshnetError: 401 (join token or signature), 409 (id bound to another key), 426
                (protocol revision), 422 (a field), or the tracker unreachable.
        """
        headers = {HEADER_JOIN_TOKEN: self.join_token} if self.join_token else {}
        body = await self._call("POST", "/v1/nodes/register", "register node", json=payload.model_dump(mode="json"),
                                headers=headers, retry=True)
        return _parse(RegisterResponse, body, "register node")

    async def heartbeat(self, node_id: str, payload: HeartbeatRequest) -> HeartbeatResponse:
        body = await self._call("POST", f"/v1/nodes/{node_id}/heartbeat", "heartbeat",
                                json=payload.model_dump(mode="json"), retry=True)
        return _parse(HeartbeatResponse, body, "heartbeat")

    async def announce_drain(self, node_id: str, timeout_s: float = 5.0) -> dict:
        """Tell the tracker this node is draining: no new routes or entry choices through it."""
        return await self._call("POST", f"/v1/nodes/{node_id}/drain", "announce drain", timeout=timeout_s, retry=True)

    async def deregister(self, node_id: str, timeout_s: float = 5.0) -> dict:
        """Remove this node from the tracker now (instead of waiting for the heartbeat timeout)."""
        return await self._call("DELETE", f"/v1/nodes/{node_id}", "deregister node", timeout=timeout_s, retry=True)

    async def report_failure(self, node_id: str, reason: str, ticket: str | None = None) -> None:
        """Tell the tracker that hop ``node_id`` failed, with the session ``ticket`` whose route
        named it (the tracker counts the report only then)."""
        await self._call("POST", f"/v1/nodes/{node_id}/failure", "report hop failure",
                         json=FailureReport(reason=reason[:2000], ticket=ticket or "").model_dump(), retry=True)

    async def report_audit(self, node_id: str, report: AuditReport) -> dict:
        """Send the tracker an audit's dispute over ``node_id`` with its signed steps (ADR-0067;
        signed by the client's auth, an entry node's :class:`NodeSigner`); the tracker's verdict
        (``{"verdict", "reason", "distances"}``)."""
        return await self._call("POST", f"/v1/nodes/{node_id}/audit", "report an audit",
                                json=report.model_dump(), timeout=AUDIT_TIMEOUT_S)

    async def _route(self, model: str, start_layer: int, end_layer: int, exclude: frozenset[str],
                     session: str | None = None, like: str | None = None) -> RouteResponse:
        params = {"model": model, "start_layer": start_layer, "end_layer": end_layer}
        if session is not None:
            params["session"] = session
        if like is not None:
            params["like"] = like
        if exclude:
            params["exclude"] = ",".join(sorted(exclude))
        return _parse(RouteResponse, await self._call("GET", "/v1/route", "route lookup", params=params),
                      "route lookup")

    async def route(self, model: str, start_layer: int, end_layer: int,
                    exclude: frozenset[str] = frozenset()) -> list[Hop]:
        """Hops serving layers ``start_layer..end_layer`` (inclusive) of ``model``, in order."""
        return (await self._route(model, start_layer, end_layer, exclude)).to_hops()

    async def session_route(self, model: str, start_layer: int, end_layer: int, session: str,
                            exclude: frozenset[str] = frozenset(), like: str | None = None) -> Route:
        """Hops serving layers ``start_layer..end_layer`` (inclusive) of ``model`` for ``session``,
        with the session's ticket (ADR-0038). The call is signed by the client's auth (an entry
        node's :class:`NodeSigner`). ``like``: only holders of the same recipe as that node's
        shard over these layers (a spot-check's witnesses, ADR-0042).

        Raises:
            MeshnetError: 401 (unsigned or unknown signer), 403 (not an entry node of the model, or
                the session belongs to another entry), 503 ``model_loading`` (no route), or the
                tracker unreachable; 502 ``bad_response`` when the answer carries no ticket.
        """
        route = (await self._route(model, start_layer, end_layer, exclude, session, like)).to_route()
        if not route.ticket:
            raise MeshnetError("route lookup: the tracker sent no session ticket", code="bad_response", status=502,
                               hint="tracker and node versions may differ")
        return route

    async def node_key(self, node_id: str) -> str | None:
        """The public key bound to ``node_id`` (base64url), None when the tracker knows no such id.

        Raises:
            MeshnetError: the tracker is unreachable or answers another error.
        """
        try:
            body = await self._call("GET", f"/v1/nodes/{node_id}/key", "node key")
        except MeshnetError as exc:
            if exc.status == 404:
                return None
            raise
        return str(body["public_key"])

    async def nodes(self) -> list[dict]:
        """Every node's view (validated against :class:`meshnet.protocol.views.NodeView`)."""
        body = await self._call("GET", "/v1/nodes", "list nodes")
        return _parse(NodeList, body, "list nodes").model_dump()["nodes"]

    async def coverage(self, model: str | None = None) -> dict:
        """One model's coverage map, or ``{"models": [...]}`` for all, validated against
        :mod:`meshnet.protocol.views` (the CLI and console read the validated dict)."""
        path = f"/v1/coverage/{model}" if model else "/v1/coverage"
        body = await self._call("GET", path, "coverage")
        return _parse(Coverage if model else CoverageList, body, "coverage").model_dump()

    async def models(self) -> dict:
        return await self._call("GET", "/v1/models", "list models")

    async def directives(self) -> list[dict]:
        """Directives, newest first (validated against :class:`meshnet.protocol.control.Directive`)."""
        body = await self._call("GET", "/v1/directives", "list directives")
        return _parse(DirectiveList, body, "list directives").model_dump()["directives"]

    async def demand(self) -> dict:
        """Queued demand per tracked model (validated against :class:`meshnet.protocol.views.DemandList`)."""
        return _parse(DemandList, await self._call("GET", "/v1/demand", "demand"), "demand").model_dump()

    async def traffic(self, buckets: int | None = None) -> dict:
        """The mesh's traffic: sessions in flight, failovers, each node's recent buckets (its last
        ``buckets`` only when given, 1..60), validated against :class:`meshnet.protocol.traffic.MeshTraffic`."""
        params = {"buckets": buckets} if buckets else None
        body = await self._call("GET", "/v1/traffic", "traffic", params=params)
        return _parse(MeshTraffic, body, "traffic").model_dump()

    async def assign(self, **params) -> AssignResponse:
        return _parse(AssignResponse, await self._call("GET", "/v1/network/assign", "network assignment",
                                                       params=params), "network assignment")

    async def pin(self, model: str, node_id: str, shard: str | None = None) -> dict:
        return await self._call("POST", "/v1/operator/pin", "pin", json={"model": model, "node_id": node_id,
                                                                        "shard": shard})

    async def unpin(self, model: str, node_id: str) -> dict:
        return await self._call("POST", "/v1/operator/unpin", "unpin", json={"model": model, "node_id": node_id})

    async def reload(self, node_id: str) -> dict:
        return await self._call("POST", "/v1/operator/reload", "reload", json={"node_id": node_id})

    async def doctor(self, node_id: str) -> dict:
        return await self._call("POST", "/v1/operator/doctor", "doctor", json={"node_id": node_id})

    async def doctor_wait(self, node_id: str, timeout_s: float = 300.0) -> dict:
        """:meth:`doctor` allowing ``timeout_s``: the tracker answers only once the node has run a
        real forward pass on each shard, which outlasts a client's usual timeout."""
        return await self._call("POST", "/v1/operator/doctor", "doctor", json={"node_id": node_id},
                                timeout=timeout_s)

    async def drain(self, node_id: str) -> dict:
        return await self._call("POST", "/v1/operator/drain", "drain", json={"node_id": node_id})

    async def reinstate(self, node_id: str) -> dict:
        """Lift ``node_id``'s quarantine (operator action, ADR-0042)."""
        return await self._call("POST", "/v1/operator/reinstate", "reinstate", json={"node_id": node_id})

    async def trust(self, node_id: str, trusted: bool = True) -> dict:
        """Trust ``node_id``, or no longer (operator action, ADR-0069)."""
        return await self._call("POST", "/v1/operator/trust", "trust", json={"node_id": node_id, "trusted": trusted})

    async def chat(self, payload: dict, timeout_s: float = 300.0) -> dict:
        return await self._call("POST", "/v1/chat/completions", "chat", json=payload, timeout=timeout_s)

    async def health(self) -> dict:
        """Liveness: 200 while the tracker process runs."""
        return await self._call("GET", "/v1/health", "health")

    async def ready(self, model: str | None = None) -> dict:
        """Readiness ``{"ready", "reasons", "models"}`` (of ``model`` alone when given), 200 or 503 alike.

        Raises:
            MeshnetError: the tracker is unreachable, or ``model`` is unknown (404).
        """
        return await self._ready("tracker readiness", params={"model": model} if model else None)


class NodeClient(_Base):
    """Client of a node's probes (``meshnet ready --node``)."""

    async def health(self) -> dict:
        """Liveness: 200 while the node process runs."""
        return await self._call("GET", "/v1/health", "node health")

    async def ready(self) -> dict:
        """Readiness ``{"ready", "reasons", ...}``, 200 or 503 alike.

        Raises:
            MeshnetError: the node is unreachable.
        """
        return await self._ready("node readiness")
