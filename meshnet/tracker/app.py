"""Tracker HTTP service (Starlette).

Routes (JSON unless noted; ``shard_start``/``shard_end``/``start_layer``/``end_layer`` are
inclusive on the wire, ADR-0002):
    POST /v1/nodes/register, POST /v1/nodes/{id}/heartbeat, POST /v1/nodes/{id}/failure
    POST /v1/nodes/{id}/drain, DELETE /v1/nodes/{id}  (a node's own drain and leave, ADR-0032)
    POST /v1/nodes/{id}/quarantine  (an entry's spot-check verdict with its evidence, ADR-0042)
    POST /v1/nodes/{id}/audit       (an entry's audit with the hop's signed steps; the tracker re-runs them, ADR-0067)
        (registration: join token when set, signed by the key it registers; every later node
        call signed by the node's bound key, ADR-0035)
    GET  /v1/route[?session=] (with a session: signed by its entry node, answered with a ticket, ADR-0038)
    GET  /v1/nodes, /v1/coverage, /v1/coverage/{model}, /v1/route, /v1/network/assign,
         /v1/directives, /v1/demand, /v1/models, /metrics
    GET  /v1/traffic[?buckets=N]  (every node's sessions in flight, failovers and recent TTFT/TPOT/batch sizes, ADR-0046)
    GET  /v1/health (liveness; ``local_node`` when it serves layers too, ADR-0044),
         /v1/ready[?model=] (readiness: 200, or 503 with reasons)
    POST /v1/chat/completions  (forwarded to an entry node, or answered by the tracker's own entry node
        in-process when it serves the first layers, ADR-0044; 503 model_loading when not routable)
    POST /v1/operator/{pin,reload,doctor,drain,reinstate}  (bearer operator token when configured)
    GET  /v1/nodes/{id}/key  (the public key bound to a node id: relays on nodes check attaches with it)
    WS   /v1/tunnel/{id}  (a relayed node's tunnel, signed by its key), and
    *    /v1/relay/{id}/...  (HTTP and WebSocket to that node through its tunnel, ADR-0045)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Awaitable

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.drain import Drain, DrainMiddleware
from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.protocol.http import BodyLimit, error_response, http_error
from meshnet.protocol.limits import ClientLimit
from meshnet.protocol.completions import read_completion_request
from meshnet.protocol.openai import find_model, model_entry, read_chat_request
from meshnet.layers import LayerRange
from meshnet.presets import canonical_model_name, default_model, model_aliases
from meshnet.tracker import operator, proxy, views
from meshnet.tracker.auth import NodeAuth, exposure_problem
from meshnet.tracker.metrics import TrackerMetrics
from meshnet.tracker.node_api import audit, deregister, drain_node, failure, heartbeat, node_key, probe_soon, quarantine, \
    register, service_of as _svc, public_key, signed_by, start_challenges, start_speed_probes
from meshnet.tracker.groupcommit import GroupCommit
from meshnet.tracker.heap import HeapFreezer
from meshnet.tracker.rebalance import rebalance_off_loop
from meshnet.tracker.sharing import Sharing
from meshnet.tracker.store import LeaseLost
from meshnet.protocol.control import AssignResponse
from meshnet.protocol.traffic import BUCKET_COUNT
from meshnet.protocol.views import CoverageList, DemandList, DemandRow
from meshnet.protocol.route import Hop, RouteResponse
from meshnet.protocol.waits import wait_event
from meshnet.relay.hub import DEFAULT_RELAY_BODY_BYTES, RelayHub
from meshnet.tracker.service import TrackerService, TrackerSettings
from meshnet.tracker.traffic import TrafficGatherer, last_buckets

log = logging.getLogger(__name__)

#: what a session id may look like (an entry node uses 32 hex digits)
_SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _int_param(request: Request, name: str, default: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise InvalidRequest(f"missing query parameter '{name}'", code="invalid_field", status=422)
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"query parameter '{name}' must be an integer", code="invalid_field",
                             status=422) from None
    if value < 0:
        raise InvalidRequest(f"query parameter '{name}' must be >= 0", code="invalid_field", status=422)
    return value


def relay_hub(app: Starlette, max_body_bytes: int) -> RelayHub:
    """The tracker's relay (ADR-0045): only a registered node, signing with its bound key, attaches
    for its own id; an attach has the node probed at once (its shards count again as soon as the
    probe through the tunnel answers), a closed tunnel makes it unreachable at once."""

    async def authorize(node_id: str, headers, method: str, target: str) -> None:
        svc = app.state.service
        app.state.auth.verify_node_call(await public_key(svc, node_id), headers, method, target, b"", as_node=node_id)

    def attached(node_id: str) -> None:
        node = app.state.service.nodes.get(node_id)
        if node is not None:
            probe_soon(app, node_id, node.endpoint)

    def detached(node_id: str) -> None:
        svc: TrackerService = app.state.service
        node = svc.nodes.get(node_id)
        if node is not None:
            svc.set_reachability(node_id, node.endpoint, "its relay tunnel closed (the node dials again by itself)")
            if svc.dirty:
                app.state.wake.set()

    return RelayHub(authorize, max_body_bytes=max_body_bytes, on_attach=attached, on_detach=detached)


async def nodes(request: Request) -> JSONResponse:
    return JSONResponse(views.nodes_view(_svc(request)).model_dump())


async def traffic(request: Request) -> JSONResponse:
    """The mesh's traffic, gathered from the nodes on demand (cached briefly, ADR-0046); with
    ``buckets=N`` (1..60) each node's last N history buckets only. Session ids only to the operator
    (its token, when the tracker has one); anyone else sees their aliases (ADR-0049)."""
    count = _int_param(request, "buckets", BUCKET_COUNT)
    if not 1 <= count <= BUCKET_COUNT:
        raise InvalidRequest(f"query parameter 'buckets' must be 1..{BUCKET_COUNT}, got {count}",
                             code="invalid_field", status=422)
    body = last_buckets(await request.app.state.traffic.traffic(), count)
    return JSONResponse((body if operator.is_operator(request) else body.redacted()).model_dump())


async def coverage_one(request: Request) -> JSONResponse:
    return JSONResponse(_svc(request).coverage(request.path_params["model"]).model_dump())


async def coverage_all(request: Request) -> JSONResponse:
    svc = _svc(request)
    return JSONResponse(CoverageList(models=[svc.coverage(m.name) for m in svc.tracked_models()]).model_dump())


async def route(request: Request) -> JSONResponse:
    """Hops over the asked layers. With ``session=<id>`` the call must be signed by an entry node of
    the model and the answer carries the session's ticket naming the hops (ADR-0038); with
    ``like=<node id>`` only shards of that node's recipe are used (spot-check witnesses, ADR-0042)."""
    svc = _svc(request)
    model = request.query_params.get("model")
    if not model:
        raise InvalidRequest("missing query parameter 'model'", code="invalid_field", status=422)
    session = request.query_params.get("session")
    if session is not None and not _SESSION_ID.fullmatch(session):
        raise InvalidRequest("query parameter 'session' must be 1-128 characters of A-Z a-z 0-9 . _ -",
                             code="invalid_field", status=422)
    entry = await signed_by(request, await request.body()) if session is not None else None
    info = svc.ensure_model(model)
    start = _int_param(request, "start_layer", 0)
    end = _int_param(request, "end_layer", info.num_layers - 1)
    if end < start:
        raise InvalidRequest("end_layer must be >= start_layer", code="invalid_field", status=422)
    exclude = frozenset(x for x in request.query_params.get("exclude", "").split(",") if x)
    hops = svc.route(info.name, LayerRange.from_inclusive(start, end), exclude, request.query_params.get("like"))
    ticket = svc.session_ticket(entry, session, info.name, hops) if entry is not None else None
    # a session's route answers for its entry's own layers too (ADR-0069)
    entry_layers = [Hop(entry, "", LayerRange(0, start))] if entry is not None and start > 0 else []
    body = RouteResponse(model=info.name, hops=[h.to_json() for h in hops], ticket=ticket,
                         unverified=svc.unverified_hops(info.name, hops),
                         verified=svc.hops_verified(info.name, entry_layers + hops))
    return JSONResponse(body.model_dump(exclude_none=True))


async def network_assign(request: Request) -> JSONResponse:
    """ADR-0011: which range a joining node should serve."""
    svc = _svc(request)
    repo = request.query_params.get("hf_repo")
    if not repo:
        raise InvalidRequest("missing query parameter 'hf_repo'", code="invalid_field", status=422)
    vram_mb = _int_param(request, "vram_mb", 8192)
    if vram_mb <= 0:
        raise InvalidRequest("vram_mb must be > 0", code="invalid_field", status=422)
    info = svc.ensure_model(repo)
    quant = request.query_params.get("quantization", "bfloat16")
    layers, gap = svc.suggest_range(info, vram_mb * 1024 * 1024, quant)
    start, end = layers.to_inclusive()
    return JSONResponse(AssignResponse(hf_repo=info.hf_repo or info.name, model=info.name, shard_start=start,
                                       shard_end=end, num_layers=info.num_layers, gap_found=gap).model_dump())


async def directives(request: Request) -> JSONResponse:
    rows = await asyncio.to_thread(_svc(request).store.directives, node_id=request.query_params.get("node_id"))
    return JSONResponse({"directives": [d.model_dump(mode="json") for d in rows]})


async def demand(request: Request) -> JSONResponse:
    svc = _svc(request)
    return JSONResponse(DemandList(demand=[DemandRow(model=m.name, requests_per_min=round(svc.demand_rate(m.name), 3),
                                                     routable=svc.coverage(m.name).routable)
                                           for m in svc.tracked_models()]).model_dump())


def _model_entries(svc: TrackerService) -> list[dict]:
    """Every model the tracker keeps, with its layer count, whether a chat can be served now, and
    its aliases."""
    return [model_entry(m.name, svc.started_at, num_layers=m.num_layers, routable=svc.coverage(m.name).routable,
                        aliases=model_aliases(m.name)) for m in svc.tracked_models()]


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": _model_entries(_svc(request))})


async def get_model(request: Request) -> JSONResponse:
    """``GET /v1/models/{id}`` (an alias too); 404 ``model_not_found`` for a model the tracker does not keep."""
    asked = request.path_params["model"]
    return JSONResponse(find_model(_model_entries(_svc(request)), asked, canonical_model_name(asked)))


async def health(request: Request) -> JSONResponse:
    """Liveness: the tracker's counts; with a node of its own (ADR-0044) ``local_node`` names it and
    says why it failed to start (``error``, None while it starts or runs)."""
    svc = _svc(request)
    body = {"status": "ok", "draining": request.app.state.drain.draining, "nodes": len(svc.nodes),
            "models": [m.name for m in svc.tracked_models()], "leader": svc.leader}
    local: proxy.LocalNode | None = request.app.state.local_node
    if local is not None:
        body["local_node"] = {"node_id": local.node_id, "error": request.app.state.local_node_error}
    return JSONResponse(body)


async def ready(request: Request) -> JSONResponse:
    """Readiness (ADR-0032): 200 ``{"ready": true, ...}`` or 503 ``{"ready": false, "reasons": [...]}``."""
    body = _svc(request).readiness(request.query_params.get("model"), draining=request.app.state.drain.draining)
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


async def chat(request: Request) -> Response:
    """Forward the chat body to an entry node; the next one when it is unreachable, draining or
    out of session room (:mod:`meshnet.tracker.proxy`). Streams pass straight through. When this
    process runs an admitted entry node of the model itself (ADR-0044), that node answers
    in-process, and the remote entries only if it refuses."""
    body = await request.body()
    return await _to_entry(request, body, (await read_chat_request(body)).model, proxy.CHAT_PATH)


async def text_completions(request: Request) -> Response:
    """``POST /v1/completions``, forwarded to an entry node as chats are (:func:`chat`)."""
    body = await request.body()
    return await _to_entry(request, body, (await read_completion_request(body)).model, proxy.COMPLETIONS_PATH)


async def _to_entry(request: Request, body: bytes, model: str | None, path: str) -> Response:
    """``body`` to ``path`` of an entry node of ``model`` (counted as served demand)."""
    svc = _svc(request)
    model = canonical_model_name(model or default_model())
    entries = svc.entry_nodes(model)
    svc.metrics.requests.labels(model=model).inc()
    svc.add_served(model)
    local: proxy.LocalNode | None = request.app.state.local_node
    remote = [n for n in entries if local is None or n.node_id != local.node_id]

    def forward(nodes) -> Awaitable[Response]:
        return proxy.forward_chat(svc, request.app.state.http, nodes, body,
                                  lambda node: probe_soon(request.app, node.node_id, node.endpoint),
                                  request.is_disconnected, path=path)

    if local is not None and len(remote) < len(entries):
        others = remote[:proxy.ENTRY_TRIES - 1]
        return proxy.LocalChat(local, body, fallback=(lambda: forward(others)) if others else None, path=path)
    return await forward(remote[:proxy.ENTRY_TRIES])


async def metrics(request: Request) -> Response:
    svc = _svc(request)
    body, ctype = svc.metrics.render(svc)
    return Response(body, media_type=ctype)


#: finished directives are pruned at most this often, seconds (ADR-0037)
PRUNE_INTERVAL_S = 60.0


async def prune_directives(svc: TrackerService) -> int:
    """Delete finished directives older than ``directive_retention_s`` and demand events older than
    the demand window, on a worker thread; returns how many directives."""
    pruned = await asyncio.to_thread(svc.store.prune_finished, svc.settings.directive_retention_s)
    await asyncio.to_thread(svc.store.prune_demand, time.time() - svc.settings.demand_window_s)
    if pruned:
        log.info("pruned %d finished directive(s) older than %.0f s", pruned, svc.settings.directive_retention_s)
    return pruned


async def control_loop(app: Starlette) -> None:
    """Every second: lead or stand by, and share the registry with the other trackers of the
    database (:mod:`meshnet.tracker.sharing`); probe unreachable nodes again and check dropouts.
    The leader alone rebalances, on every join/leave/reachability change and every rebalance
    interval (the store write off the loop), and prunes every :data:`PRUNE_INTERVAL_S`."""
    svc: TrackerService = app.state.service
    sharing = Sharing(svc)
    heap = HeapFreezer()
    last = 0.0
    pruned_s = 0.0
    while True:
        await wait_event(app.state.wake, 1.0)
        app.state.wake.clear()
        heap.tick()  # short collector pauses at 10,000 nodes (ADR-0059)
        try:
            leading = await sharing.sync_round()
            start_challenges(app)
            start_speed_probes(app)
            for node in svc.to_probe():
                probe_soon(app, node.node_id, node.endpoint)
            await svc.check_dropouts_off_loop()
            if not leading:
                continue
            # joins in progress hold the periodic round too (nodes that join together are planned
            # together), but never longer than one settle window past its time
            now, settings = time.monotonic(), svc.settings
            settled = now - svc.last_join_s >= settings.join_settle_s
            due = now - last >= settings.rebalance_interval_s
            if (settled and (svc.dirty or due)) or now - last >= settings.rebalance_interval_s + settings.join_settle_s:
                await rebalance_off_loop(svc)
                last = time.monotonic()
            if time.monotonic() - pruned_s >= PRUNE_INTERVAL_S:
                pruned_s = time.monotonic()
                await prune_directives(svc)
        except LeaseLost as exc:  # a frozen leader woke up after its successor took over
            log.warning("this tracker lost the lease; its write was refused: %s", exc)
            svc.leader = False
        except Exception as exc:  # noqa: BLE001 - the loop must survive any single bad round
            if isinstance(exc, svc.store.database_errors) or getattr(exc, "code", "") == "database_unreachable":
                log.warning("control loop round: tracker database unreachable: %s", exc)  # reconnects next round
            else:
                log.exception("control loop round failed")


async def _on_error(request: Request, exc: MeshnetError) -> Response:
    return error_response(exc)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    """Any other exception: the JSON envelope (500 ``internal_error``), never plain text; the
    database unreachable (or its connection broken) is 503 ``database_unreachable``, and the
    tracker carries on while the sync round reconnects (ADR-0054)."""
    if isinstance(exc, request.app.state.service.store.database_errors):
        log.warning("%s %s: tracker database unreachable: %s", request.method, request.url.path, exc)
        return error_response(MeshnetError(f"the tracker's database is unreachable: {exc}".strip(),
                                           code="database_unreachable", status=503,
                                           hint="try again shortly, or another tracker of this network"))
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(MeshnetError(f"internal error on tracker: {type(exc).__name__}: {exc}"))


def _routes() -> list:
    """The tracker's HTTP routes (the relay adds its own when the app is built)."""
    return [Route("/v1/nodes/register", register, methods=["POST"]),
            Route("/v1/nodes/{node_id}/heartbeat", heartbeat, methods=["POST"]),
            Route("/v1/nodes/{node_id}/failure", failure, methods=["POST"]),
            Route("/v1/nodes/{node_id}/drain", drain_node, methods=["POST"]),
            Route("/v1/nodes/{node_id}/quarantine", quarantine, methods=["POST"]),
            Route("/v1/nodes/{node_id}/audit", audit, methods=["POST"]),
            Route("/v1/nodes/{node_id}", deregister, methods=["DELETE"]),
            Route("/v1/nodes/{node_id}/key", node_key),
            Route("/v1/nodes", nodes), Route("/v1/traffic", traffic), Route("/v1/coverage", coverage_all),
            Route("/v1/coverage/{model:path}", coverage_one), Route("/v1/route", route),
            Route("/v1/network/assign", network_assign), Route("/v1/directives", directives),
            Route("/v1/demand", demand), Route("/v1/models", models), Route("/v1/models/{model:path}", get_model), Route("/v1/health", health),
            Route("/v1/ready", ready),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]), Route("/metrics", metrics),
            *operator.routes()]


def build_app(settings: TrackerSettings = TrackerSettings(), service: TrackerService | None = None,
              *, run_loop: bool = True, transport: httpx.AsyncBaseTransport | None = None,
              local_node: proxy.LocalNode | None = None) -> Starlette:
    """Create the tracker app; the lifespan runs the control loop unless ``run_loop`` is False.

    ``transport`` carries the tracker's own calls to nodes (probes, chat forwarding, doctor);
    tests pass an ``httpx.MockTransport`` or ``ASGITransport`` (default: the network).
    ``local_node``: the node this process also runs (ADR-0044, :mod:`meshnet.trackernode`); chats
    its admitted entry shards can serve go to it in-process."""

    settings = service.settings if service else settings
    problem = exposure_problem(settings.host, settings.join_token, settings.operator_token, settings.insecure)
    if problem:
        raise MeshnetError(problem, code="insecure_tracker")
    drain = Drain(settings.drain_grace_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        app.state.service = service or TrackerService(settings)
        app.state.service.metrics = TrackerMetrics()
        app.state.wake = asyncio.Event()
        app.state.probing = {}
        app.state.challenging = set()
        store_errors = app.state.service.store.database_errors
        app.state.binding = GroupCommit(app.state.service.bind_many, store_errors)
        app.state.registering = GroupCommit(app.state.service.register_stores, store_errors)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), transport=transport) as http:
            app.state.http = http
            task = asyncio.create_task(control_loop(app)) if run_loop else None
            try:
                yield
            finally:
                for pending in [task, *app.state.probing.values(), *app.state.challenging]:
                    if pending is not None:
                        pending.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await pending
                await app.state.service.writes_done()
                app.state.service.store.resign()  # a standby of the same database takes over now

    routes = _routes()
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                                           prefix_limits={"/v1/relay/": DEFAULT_RELAY_BODY_BYTES}),
                                Middleware(ClientLimit, max_requests=settings.max_client_requests),
                                Middleware(DrainMiddleware, drain=drain)],
                    exception_handlers={MeshnetError: _on_error, HTTPException: http_error,
                                        Exception: _unexpected_error})
    app.state.auth = NodeAuth(settings.join_token)
    app.state.traffic = TrafficGatherer(lambda: app.state.http, lambda: [
        (n.node_id, n.endpoint) for n in app.state.service.nodes.values()],  # ADR-0046
        sign=lambda method, path: app.state.service.tickets.sign_call(method, path))
    app.state.local_node = local_node
    app.state.local_node_error = None  # set by the composition when that node fails to start
    app.state.relay = relay_hub(app, DEFAULT_RELAY_BODY_BYTES)
    app.router.routes.extend(app.state.relay.routes())
    app.state.drain = drain  # SIGTERM: new chats 503, proxied chats get drain_grace_s to finish (ADR-0032)
    return app
