"""Operator actions: pin, unpin, reload, doctor, drain, reinstate, trust (``POST /v1/operator/...``).

Protected by a bearer token when the tracker has one (``--operator-token`` /
``MESHNET_OPERATOR_TOKEN``). Pins are stored in the tracker's database and survive restarts; pinned
shards are never retargeted by placement (ADR-0026).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from meshnet.errors import InvalidRequest, MeshnetError, NotFound, Unauthorized
from meshnet.protocol.http import same_secret, validate_json
from meshnet.layers import LayerRange
from meshnet.protocol.control import DoctorResponse


class PinRequest(BaseModel):
    model: str = Field(min_length=1)
    node_id: str = Field(min_length=1)
    shard: str | None = Field(default=None, pattern=r"^\d+-\d+$")


class UnpinRequest(BaseModel):
    model: str = Field(min_length=1)
    node_id: str = Field(min_length=1)


class NodeRequest(BaseModel):
    node_id: str = Field(min_length=1)


def is_operator(request: Request) -> bool:
    """Whether ``request`` carries the operator's bearer token (always, on a tracker without one)."""
    token = request.app.state.service.settings.operator_token
    if not token:
        return True
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return same_secret(given, token)


def _authorize(request: Request) -> None:
    if not is_operator(request):
        raise Unauthorized("operator token missing or wrong", hint="pass --token or set MESHNET_OPERATOR_TOKEN")


async def pin(request: Request) -> JSONResponse:
    _authorize(request)
    req = validate_json(PinRequest, await request.body())
    layers = None
    if req.shard:
        try:
            layers = LayerRange.parse(req.shard)
        except ValueError as exc:
            raise InvalidRequest(f"invalid field 'shard': {exc}", code="invalid_field", status=422) from exc
    pinned, queued = request.app.state.service.pin(req.node_id, req.model, layers)
    return JSONResponse({"pinned": pinned, "directives": [d.model_dump() for d in queued]})


async def unpin(request: Request) -> JSONResponse:
    _authorize(request)
    req = validate_json(UnpinRequest, await request.body())
    removed = request.app.state.service.unpin(req.node_id, req.model)
    if not removed:
        raise NotFound(f"no pin of {req.model} on {req.node_id}", code="pin_not_found",
                       hint="`meshnet nodes` shows pinned shards")
    return JSONResponse({"unpinned": {"node_id": req.node_id, "model": req.model}})


async def reload(request: Request) -> JSONResponse:
    _authorize(request)
    node_id = validate_json(NodeRequest, await request.body()).node_id
    return JSONResponse({"directive": request.app.state.service.reload(node_id).model_dump()})


async def doctor(request: Request) -> JSONResponse:
    """Run doctor on the node now (synchronously through its API) and return its reports."""
    _authorize(request)
    svc = request.app.state.service
    node = svc.get(validate_json(NodeRequest, await request.body()).node_id)
    directive = svc.queue_directive(node.node_id, "RUN_DOCTOR", reason="operator doctor")
    svc.store.set_status(directive.id, "delivered")
    try:
        url = f"{node.endpoint}/v1/doctor"  # a node runs doctor only for its tracker (ADR-0056)
        resp = await request.app.state.http.post(url, timeout=300.0, headers=svc.tickets.sign_call("POST", url))
        resp.raise_for_status()
        reports = DoctorResponse.model_validate(resp.json()).reports
    except Exception as exc:  # noqa: BLE001 - unreachable, error status, a body without valid reports
        why = f"{type(exc).__name__}: {exc}"
        svc.store.set_status(directive.id, "failed", why)
        raise MeshnetError(f"doctor on {node.node_id} at {node.endpoint} failed: {why}", code="doctor_failed",
                           status=502) from exc
    failed = svc.record_doctor(node.node_id, reports)
    svc.store.set_status(directive.id, "failed" if failed else "done", "; ".join(failed) or None)
    return JSONResponse({"node_id": node.node_id, "reports": [r.model_dump() for r in reports]})


async def drain(request: Request) -> JSONResponse:
    _authorize(request)
    svc = request.app.state.service
    node = svc.drain(validate_json(NodeRequest, await request.body()).node_id)
    return JSONResponse({"node_id": node.node_id, "draining": True})


async def reinstate(request: Request) -> JSONResponse:
    """Lift a node's quarantine (ADR-0042): its shards count again once their reports do."""
    _authorize(request)
    svc = request.app.state.service
    node_id = validate_json(NodeRequest, await request.body()).node_id
    was = svc.reinstate(node_id)
    request.app.state.wake.set()
    return JSONResponse({"node_id": node_id, "reinstated": was})


class TrustRequest(BaseModel):
    """Body of ``POST /v1/operator/trust``: the node, and whether the operator trusts it."""

    model_config = ConfigDict(extra="forbid")
    node_id: str = Field(min_length=1, max_length=128)
    trusted: bool = True


async def trust(request: Request) -> JSONResponse:
    """Trust a node, or no longer (ADR-0069): its shards are verified on the operator's word, its
    weights digest is the one known for its range and recipe, and it is the first reference of
    other holders' challenges."""
    _authorize(request)
    svc = request.app.state.service
    body = validate_json(TrustRequest, await request.body())
    changed = svc.trust(body.node_id, body.trusted)
    request.app.state.wake.set()
    return JSONResponse({"node_id": body.node_id, "trusted": body.trusted, "changed": changed})


def routes() -> list[Route]:
    return [Route("/v1/operator/pin", pin, methods=["POST"]),
            Route("/v1/operator/unpin", unpin, methods=["POST"]), Route("/v1/operator/reload", reload, methods=["POST"]),
            Route("/v1/operator/doctor", doctor, methods=["POST"]), Route("/v1/operator/drain", drain, methods=["POST"]),
            Route("/v1/operator/reinstate", reinstate, methods=["POST"]),
            Route("/v1/operator/trust", trust, methods=["POST"])]
