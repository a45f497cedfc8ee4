"""Operator actions: pin, reload, doctor, drain (``POST /v1/operator/...``).

Protected by a bearer token when the tracker has one (``--operator-token`` /
``MESHNET_OPERATOR_TOKEN``). Pins are stored in sqlite and survive restarts; pinned
shards are never retargeted by placement (ADR-0026).
"""

from __future__ import annotations

import hmac

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from meshnet.errors import InvalidRequest, MeshnetError, Unauthorized
from meshnet.gateway.schema import validate_json
from meshnet.layers import LayerRange
from meshnet.tracker import placement


class PinRequest(BaseModel):
    model: str = Field(min_length=1)
    node_id: str = Field(min_length=1)
    shard: str | None = Field(default=None, pattern=r"^\d+-\d+$")


class NodeRequest(BaseModel):
    node_id: str = Field(min_length=1)


def _authorize(request: Request) -> None:
    token = request.app.state.service.settings.operator_token
    if not token:
        return
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given, token):
        raise Unauthorized("operator token missing or wrong", hint="pass --token or set MESHNET_OPERATOR_TOKEN")


async def pin(request: Request) -> JSONResponse:
    _authorize(request)
    svc = request.app.state.service
    req = validate_json(PinRequest, await request.body())
    node = svc.get(req.node_id)
    info = svc.ensure_model(req.model)
    if req.shard:
        try:
            layers = LayerRange.parse(req.shard)
        except ValueError as exc:
            raise InvalidRequest(f"invalid field 'shard': {exc}", code="invalid_field", status=422) from exc
        if layers.end > info.num_layers:
            raise InvalidRequest(f"shard {req.shard} beyond {info.name}'s {info.num_layers} layers",
                                 code="invalid_field", status=422)
    else:
        spec = placement.ModelSpec(info.name, info.num_layers, info.bytes_per_layer)
        counts = placement.coverage_counts(info.num_layers, [s.layers for _, s in svc.admitted_shards(info.name)])
        layers, _ = placement.find_assignment(spec, counts, node.vram_bytes, node.quantization)
    start, end = layers.to_inclusive()
    svc.store.add_model(info.name)
    svc.store.add_pin(node.node_id, info.name, start, end)
    queued = []
    free = node.max_loaded_shards - len(node.shards)
    for shard in sorted(node.shards, key=lambda s: s.tier != "managed"):
        if free >= 1:
            break
        if shard.tier != "pinned":
            s0, s1 = shard.layers.to_inclusive()
            queued.append(svc.store.add_directive(node.node_id, "DROP_SHARD", model=shard.model, shard_start=s0,
                                                  shard_end=s1, tier=shard.tier, reason="operator pin"))
            free += 1
    queued.append(svc.store.add_directive(node.node_id, "LOAD_SHARD", model=info.name, shard_start=start,
                                          shard_end=end, tier="pinned", reason="operator pin"))
    return JSONResponse({"pinned": {"node_id": node.node_id, "model": info.name, "shard_start": start,
                                    "shard_end": end}, "directives": queued})


async def reload(request: Request) -> JSONResponse:
    _authorize(request)
    svc = request.app.state.service
    node = svc.get(validate_json(NodeRequest, await request.body()).node_id)
    node.mark_reports_stale()  # out of routes until the next passing doctor
    svc.dirty = True
    return JSONResponse({"directive": svc.store.add_directive(node.node_id, "RELOAD", reason="operator reload")})


async def doctor(request: Request) -> JSONResponse:
    """Run doctor on the node now (synchronously through its API) and return its reports."""
    _authorize(request)
    svc = request.app.state.service
    node = svc.get(validate_json(NodeRequest, await request.body()).node_id)
    directive = svc.store.add_directive(node.node_id, "RUN_DOCTOR", reason="operator doctor")
    svc.store.set_status(directive["id"], "delivered")
    try:
        resp = await request.app.state.http.post(f"{node.endpoint}/v1/doctor", timeout=300.0)
        resp.raise_for_status()
        reports = resp.json()["reports"]
    except Exception as exc:  # noqa: BLE001 - unreachable, error status, a body without reports
        why = f"{type(exc).__name__}: {exc}"
        svc.store.set_status(directive["id"], "failed", why)
        raise MeshnetError(f"doctor on {node.node_id} at {node.endpoint} failed: {why}", code="doctor_failed",
                           status=502) from exc
    by_range = {(r["model"], r["shard_start"], r["shard_end"]): r for r in reports}
    for shard in node.shards:
        start, end = shard.layers.to_inclusive()
        shard.report = by_range.get((shard.model, start, end), shard.report)
    failed = [r["reason"] for r in reports if not r["passed"]]
    svc.store.set_status(directive["id"], "failed" if failed else "done", "; ".join(failed) or None)
    svc.dirty = True
    return JSONResponse({"node_id": node.node_id, "reports": reports})


async def drain(request: Request) -> JSONResponse:
    _authorize(request)
    svc = request.app.state.service
    node = svc.get(validate_json(NodeRequest, await request.body()).node_id)
    node.draining = True
    svc.dirty = True
    return JSONResponse({"node_id": node.node_id, "draining": True})


def routes() -> list[Route]:
    return [Route("/v1/operator/pin", pin, methods=["POST"]), Route("/v1/operator/reload", reload, methods=["POST"]),
            Route("/v1/operator/doctor", doctor, methods=["POST"]), Route("/v1/operator/drain", drain, methods=["POST"])]
