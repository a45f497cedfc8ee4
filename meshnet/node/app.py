"""Node HTTP service (Starlette): forward, sessions, health, and the entry-node chat API.

Routes:
    POST   /v1/forward              activation frame in, activation frame out (headers below)
    WS     /v1/stream               hop streams: chains of sessions pushed node to node (ADR-0040)
    DELETE /v1/sessions/{id}        release a session's KV caches
    GET    /v1/transcripts/{id}     what this node's hop of a chain received and sent, for holders of its key (ADR-0067)
    GET    /v1/health               liveness: node id, endpoint, relay tunnel, shard slots, sessions, cache bytes left, draining
    GET    /v1/ready                readiness: 200 {"ready": true} or 503 {"ready": false, "reasons"} (ADR-0032)
    GET    /v1/traffic              sessions in flight as entry, recent failovers, the last minutes'
                                    TTFT/TPOT/tokens/batch sizes (ADR-0046, ``NodeTraffic``)
    POST   /v1/doctor               run doctor on the loaded shards (for its tracker only, ADR-0056)
    GET    /v1/models, POST /v1/chat/completions, POST /v1/completions   OpenAI surface (entry nodes)
    GET    /metrics                 Prometheus text

Forward headers: ``X-Meshnet-Session``, ``X-Meshnet-Start-Layer`` and
``X-Meshnet-End-Layer`` (inclusive, ADR-0002), ``X-Meshnet-Position``, optional ``X-Meshnet-Model``
and ``X-Meshnet-Last-Only: 1`` (return only the last position); ``X-Meshnet-Rewind: 1`` marks a
speculative step, which may first take the session back to its position (ADR-0058).

Session tickets (ADR-0038): once the node has registered with a tracker it knows the tracker's
key, and from then on a forward call runs only with a ticket (``X-Meshnet-Ticket``) that names
this node for exactly the asked layers of that session (401 missing/invalid/expired, 403 another
session, model, node or layers), checked before any KV cache is touched; a release needs the
session's ticket and a call signed by the entry node it names; a node without a tracker checks no tickets.

SIGTERM drains (ADR-0032, :mod:`meshnet.drain`): the node tells the tracker, refuses new
chats and new hop sessions (position 0) with 503 ``draining``, keeps serving the sessions it
holds until they end or ``drain_grace_s`` runs out, deregisters, then exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from meshnet.node import wire
from meshnet.drain import Drain, DrainMiddleware
from meshnet.errors import InvalidRequest, MeshnetError, NotFound, Unauthorized
from meshnet.gateway import completions, openai_api
from meshnet.dataplane.chain import ChainInbox
from meshnet.dataplane.frames import FLAG_LAST_ONLY, FLAG_REWIND, HEADER_REWIND
from meshnet.dataplane.receipts import HEADER_CHAIN_KEY, HEADER_RECEIPT, TranscriptStore, sign_step, transcript_json
from meshnet.protocol.signing import b64url
from meshnet.dataplane.transport import StreamPool
from meshnet.protocol.http import BodyLimit, http_error
from meshnet.protocol.limits import ClientLimit
from meshnet.gateway.traffic import TrafficLog
from meshnet.gateway.audit import Auditor
from meshnet.gateway.spotcheck import SpotChecker
from meshnet.layers import LayerRange
from meshnet.node import hardware
from meshnet.node.entry import orchestrator_for
from meshnet.node.metrics import NodeMetrics
from meshnet.node.readiness import gather_facts, node_readiness
from meshnet.node.runtime import NodeRuntime
from meshnet.node.sessions import SessionStore
from meshnet.node.settings import NodeSettings
from meshnet.node.callers import (TrackerLink, admit_hop, advertised_endpoint, asked_by_tracker, check_release,
                                  proxied_by_tracker)
from meshnet.node.wire import ChainHost, stream_endpoint
from meshnet.protocol.control import CapabilityReport, DoctorResponse
from meshnet.protocol.completions import read_completion_request
from meshnet.protocol.openai import find_model, model_entry
from meshnet.protocol.tickets import HEADER_TICKET, VerifiedTickets
from meshnet.protocol.traffic import NodeTraffic
from meshnet.presets import canonical_model_name, model_aliases

log = logging.getLogger(__name__)


@dataclass
class NodeContext:
    """What the node's handlers share (``request.app.state.node``)."""

    settings: NodeSettings
    runtime: NodeRuntime
    http: httpx.AsyncClient
    metrics: NodeMetrics = field(default_factory=NodeMetrics)
    agent: TrackerLink | None = None  # the tracker agent (meshnet.node.agent.TrackerAgent) when a tracker is configured
    started_at: float = field(default_factory=time.time)
    reports: dict[str, CapabilityReport] = field(default_factory=dict)  # slot key -> latest report
    drain: Drain = field(default_factory=Drain)
    last_forward_s: float = 0.0  # monotonic time of the latest hop call (drain: are sessions live?)
    transport: httpx.AsyncBaseTransport | None = None  # the node's outbound calls (None: the network)
    #: the tracker's key (learned at registration): hop calls need its session tickets (None: not required)
    tracker_key: Ed25519PublicKey | None = None
    tickets: VerifiedTickets = field(default_factory=VerifiedTickets)  # hop tickets already verified
    #: outbound hop streams (ADR-0040; None until the lifespan opens them, or with a test transport)
    streams: StreamPool | None = None
    chains: ChainHost | None = None  # this node's hop of every chain through it
    inbox: ChainInbox = field(default_factory=ChainInbox)  # chains this node drives as entry
    spot_checker: SpotChecker | None = None  # made with the first orchestrator (ADR-0042)
    auditor: Auditor | None = None  # made with the first orchestrator (ADR-0067)
    #: model -> the route's step times by positions, learnt across its chats (speculation, ADR-0058)
    step_costs: dict = field(default_factory=dict)
    traffic: TrafficLog = field(init=False)  # sessions in flight as entry, failovers (ADR-0046)
    #: what this node's hops received and sent, by chain, for audits (ADR-0067)
    transcripts: TranscriptStore = field(default_factory=TranscriptStore)
    #: the node key its step receipts are signed with (ADR-0067): its tracker agent's, set when the
    #: agent starts (None: no tracker, so no identity and nobody to show a receipt to). A plain
    #: attribute: every hop step reads it (ADR-0055: the token path stays out of this module)
    step_key: Ed25519PrivateKey | None = None

    def __post_init__(self) -> None:
        self.traffic = TrafficLog(self.settings.node_id)


def _state(request: Request) -> NodeContext:
    return request.app.state.node


def _int_header(request: Request, name: str, default: int | None = None) -> int:
    raw = request.headers.get(name)
    if raw is None:
        if default is None:
            raise InvalidRequest(f"missing header {name}", code="invalid_field", status=422)
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"header {name} must be an integer, got {raw!r}", code="invalid_field",
                             status=422) from None
    if value < 0:
        raise InvalidRequest(f"header {name} must be >= 0", code="invalid_field", status=422)
    return value


async def forward(request: Request) -> Response:
    node = _state(request)
    session = request.headers.get("X-Meshnet-Session")
    if not session:
        raise InvalidRequest("missing header X-Meshnet-Session", code="invalid_field", status=422)
    start = _int_header(request, "X-Meshnet-Start-Layer")
    end = _int_header(request, "X-Meshnet-End-Layer")
    if end < start:
        raise InvalidRequest("X-Meshnet-End-Layer must be >= X-Meshnet-Start-Layer", code="invalid_field", status=422)
    position = _int_header(request, "X-Meshnet-Position", 0)
    model = request.headers.get("X-Meshnet-Model")
    admit_hop(node, session=session, layers=LayerRange.from_inclusive(start, end), model=model,
              ticket=request.headers.get(HEADER_TICKET), position=position)
    node.last_forward_s = time.monotonic()
    body = await request.body()
    hidden = await wire.decode_async(body)
    t0 = time.perf_counter()
    out = await node.runtime.forward_async(model=model, session_id=session, layers=LayerRange.from_inclusive(start, end),
                                           position=position, hidden=hidden,
                                           rewind=request.headers.get(HEADER_REWIND) == "1")
    node.metrics.observe_forward(hidden.shape[1], time.perf_counter() - t0, position)
    last_only = request.headers.get("X-Meshnet-Last-Only") == "1"
    if last_only:
        out = out[:, -1:]
    frame = await wire.encode_async(out, dtype=hidden.dtype)
    flags = (FLAG_LAST_ONLY if last_only else 0) | (FLAG_REWIND if request.headers.get(HEADER_REWIND) == "1" else 0)
    return Response(frame, media_type="application/octet-stream",
                    headers=_receipt_header(node, model, session, LayerRange.from_inclusive(start, end), position,
                                            hidden.shape[1], flags, body, frame))


def _receipt_header(node: NodeContext, model: str | None, session: str, layers: LayerRange, position: int,
                    tokens: int, flags: int, frame_in: bytes, frame_out: bytes) -> dict[str, str]:
    """``X-Meshnet-Receipt``: the node's signed receipt of a hop call (ADR-0067), as a hop stream
    step's RECEIPT; none without a node key or for a session id that is not 32 hex characters."""
    key = node.step_key
    if key is None:
        return {}
    try:
        receipt = sign_step(key, canonical_model_name(model or ""), session, layers, position, tokens, flags,
                            frame_in, frame_out)
    except ValueError:
        return {}
    return {HEADER_RECEIPT: b64url(receipt.to_bytes())}


async def release_session(request: Request) -> JSONResponse:
    """The entry ends a session here: its caches go, and a late restart of it is refused (ADR-0036).
    With a tracker key, only the session's own entry may do it (:func:`check_release`)."""
    node = _state(request)
    session = request.path_params["session_id"]
    check_release(node, request, session)
    if node.chains is not None:
        node.chains.drop(session)
    dropped = await asyncio.to_thread(node.runtime.end_session, session)
    return JSONResponse({"released": dropped})


async def transcript(request: Request) -> JSONResponse:
    """What this node's hop of a chain received and sent (ADR-0067), for whoever holds the chain's
    key (its entry and its hops): an audit compares it with the hop's signed receipts.

    Raises:
        NotFound (404 ``no_transcript``): no transcript of that chain is kept here (never run here,
            gone after its keeping time or evicted by newer ones), or the key is not the chain's.
    """
    node = _state(request)
    chain_id = request.path_params["chain_id"]
    steps = node.transcripts.steps(chain_id, request.headers.get(HEADER_CHAIN_KEY, ""))
    if steps is None:
        raise NotFound(f"no transcript of chain {chain_id} is kept here for that key", code="no_transcript")
    return JSONResponse(transcript_json(chain_id, node.settings.node_id, steps))


async def health(request: Request) -> JSONResponse:
    """Liveness and state; with ``?chain=ID`` also ``"chain"``: whether this node holds that hop
    stream chain (an entry's probe of a chain that missed its deadline, ADR-0040)."""
    node = _state(request)
    rt = node.runtime
    chain = request.query_params.get("chain")
    tunnel = None if node.agent is None else node.agent.tunnel
    relay = None if tunnel is None else {"url": tunnel.relay_url, "attached": tunnel.attached.is_set(),
                                         "attaches": tunnel.attaches, "rtt_s": round(tunnel.rtt_s, 6)}
    return JSONResponse({"status": "ok", "draining": node.drain.draining, "node_id": node.settings.node_id,
                         "endpoint": advertised_endpoint(node), "relay": relay,
                         "shards": [s.model_dump(exclude={"report"}) for s in rt.describe()], "slots_total": rt.max_loaded_shards,
                         "sessions": len(rt.sessions), "cache_bytes_left": rt.sessions.bytes_left,
                         "session_cache_bytes": rt.sessions.max_bytes, "session_ttl_s": rt.sessions.ttl_s,
                         "compute_dtype": rt.compute_dtype, "rss_bytes": hardware.rss_bytes(), "uptime_s": round(time.time() - node.started_at, 1),
                         # what this entry's spot-checks found (ADR-0042); None before its first chat
                         "spot_checks": None if node.spot_checker is None else asdict(node.spot_checker.stats),
                         "audits": None if node.auditor is None else asdict(node.auditor.stats),
                         **({} if chain is None else {"chain": chain in node.chains.chains})})


async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 ``{"ready": true, "reasons": []}`` or 503 with the reasons (ADR-0032)."""
    facts = await gather_facts(_state(request))
    body = node_readiness(facts)
    body["node_id"] = _state(request).settings.node_id
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


def hop_sessions_idle(node: NodeContext) -> bool:
    """Drain test: no hop session is held, or none was used within ``drain_hop_idle_s``."""
    return (len(node.runtime.sessions) == 0
            or time.monotonic() - node.last_forward_s > node.settings.drain_hop_idle_s)


async def text_completions(request: Request) -> Response:
    """``POST /v1/completions``: OpenAI's legacy text completions (:mod:`meshnet.gateway.completions`)."""
    node = _state(request)
    req = await read_completion_request(await request.body())
    model, orchestrator = orchestrator_for(node, req.model, None)
    await asyncio.to_thread(node.runtime.check_room)  # a full cache is a 503 before any stream starts
    if req.stream:
        return await completions.stream(orchestrator, model, req)
    return await completions.complete(orchestrator, model, req, disconnected=request.is_disconnected)


async def chat_completions(request: Request) -> Response:
    node = _state(request)
    req = await openai_api.read_chat(request)
    model, orchestrator = orchestrator_for(node, req.model, req.pipelined_prefill)
    await asyncio.to_thread(node.runtime.check_room)  # a full cache is a 503 before any stream starts
    if req.stream:
        return await openai_api.stream(orchestrator, model, req)
    return await openai_api.complete(orchestrator, model, req, disconnected=request.is_disconnected)


def _model_entries(node: NodeContext) -> list[dict]:
    """The models this node answers chat for (those of its entry shards)."""
    return [model_entry(m, node.started_at, aliases=model_aliases(m))
            for m in sorted({s.model for s in node.runtime.slots.values() if s.shard.is_entry})]


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": _model_entries(_state(request))})


async def get_model(request: Request) -> JSONResponse:
    """``GET /v1/models/{id}`` (an alias too); 404 ``model_not_found`` for a model it does not serve."""
    asked = request.path_params["model"]
    return JSONResponse(find_model(_model_entries(_state(request)), asked, canonical_model_name(asked)))


async def doctor(request: Request) -> JSONResponse:
    """``POST /v1/doctor``: a forward pass per shard, so only for a call the node's tracker signed
    (:func:`asked_by_tracker`); else Unauthorized (401 ``tracker_only``), ADR-0056."""
    from meshnet.node.doctor import run_doctor_all

    node = _state(request)
    if not asked_by_tracker(node, request):
        raise Unauthorized("doctor runs on this node only when its tracker asks (a call the tracker signed)",
                           code="tracker_only", hint="ask the tracker: meshnet node doctor --node <id>")
    reports = await asyncio.to_thread(run_doctor_all, node)
    return JSONResponse(DoctorResponse(reports=reports).model_dump())


async def traffic(request: Request) -> JSONResponse:
    """This node's traffic (:class:`NodeTraffic`): sessions it drives as entry, its latest failovers,
    and the last minutes of TTFT, TPOT, forward tokens and batch sizes in buckets. Session ids
    only to its tracker (:func:`asked_by_tracker`); anyone else sees their aliases (ADR-0049)."""
    node = _state(request)
    now = node.metrics.clock()
    body = NodeTraffic(node_id=node.settings.node_id, at_s=now,
                       buckets=node.metrics.traffic_buckets(node.runtime.batch_sizes, now_s=now),
                       sessions=node.traffic.sessions(), kv_sessions=len(node.runtime.sessions),
                       failovers=node.traffic.failovers())
    return JSONResponse((body if asked_by_tracker(node, request) else body.redacted()).model_dump())


async def metrics(request: Request) -> Response:
    node = _state(request)
    node.metrics.update_gauges(node.runtime, len(node.chains) if node.chains is not None else 0)
    body, content_type = node.metrics.render()
    return Response(body, media_type=content_type)


async def _meshnet_error(request: Request, exc: MeshnetError) -> Response:
    return openai_api.error_response(exc)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    """Any other exception: the JSON envelope (500 ``internal_error``), never plain text."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return openai_api.error_response(MeshnetError(f"internal error on node: {type(exc).__name__}: {exc}"))


def build_app(settings: NodeSettings, runtime: NodeRuntime | None = None, *, start_agent: bool = True,
              transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """Create the node app. The lifespan loads the configured shard (if any) and starts the
    tracker agent (register + heartbeat loop) when ``settings.tracker_url`` is set.

    ``transport`` carries all of the node's own calls (hops, the tracker); tests pass an
    ``httpx.ASGITransport`` or ``MockTransport`` so no real server is needed (default: the network).

    ``app.state.drain`` is the node's :class:`Drain` (grace ``settings.drain_grace_s``): it
    announces to the tracker, waits for chats in flight and live hop sessions, deregisters.
    """
    drain = Drain(settings.drain_grace_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with _running_node(app, settings, runtime, drain, transport, start_agent):
            yield

    routes = _routes()
    # forward frames may be up to the wire format's limit (plus a header of at most 24 bytes)
    body_limit = Middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                            path_limits={"/v1/forward": wire.DEFAULT_MAX_BYTES + 64},
                            prefix_limits={"/v1/relay/": wire.DEFAULT_MAX_BYTES + 64})  # relayed hops, checked again by the hub
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[body_limit, Middleware(ClientLimit, max_requests=settings.max_client_requests,
                                                       exempt=proxied_by_tracker),
                                Middleware(DrainMiddleware, drain=drain)],
                    exception_handlers={MeshnetError: _meshnet_error, HTTPException: http_error,
                                        Exception: _unexpected_error})
    app.state.drain = drain
    if settings.offer_relay:
        _offer_relay(app)
    return app


def _routes() -> list:
    """The node's HTTP and WebSocket routes."""
    return [Route("/v1/forward", forward, methods=["POST"]), WebSocketRoute("/v1/stream", stream_endpoint),
            Route("/v1/sessions/{session_id}", release_session, methods=["DELETE"]),
            Route("/v1/transcripts/{chain_id}", transcript),
            Route("/v1/health", health), Route("/v1/ready", ready), Route("/v1/traffic", traffic),
            Route("/v1/doctor", doctor, methods=["POST"]), Route("/v1/models", list_models),
            Route("/v1/models/{model:path}", get_model),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]), Route("/metrics", metrics)]


@contextlib.asynccontextmanager
async def _running_node(app: Starlette, settings: NodeSettings, runtime: NodeRuntime | None, drain: Drain,
                        transport: httpx.AsyncBaseTransport | None, start_agent: bool):
    """The node's context (``app.state.node``) while ``app`` runs: its runtime, HTTP client, chain host and hop streams,
    its configured shard loaded (standalone) or its tracker agent started; all closed on exit."""
    rt = runtime or NodeRuntime(max_loaded_shards=settings.max_loaded_shards, compute_dtype=settings.compute_dtype,
                                device=settings.device, batch_window_s=settings.batch_window_s,
                                sessions=SessionStore(settings.session_ttl_s, settings.session_cache_bytes),
                                max_batch_size=settings.max_batch_size)
    # callers block in worker threads while their step is batched: the default pool (cores + 4)
    # would cap a batch at a handful of sessions (ADR-0052)
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(settings.worker_threads, thread_name_prefix="meshnet-node"))
    timeout = httpx.Timeout(settings.hop_timeout_s, connect=settings.hop_connect_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=32),
                                 transport=transport) as http:
        node = NodeContext(settings=settings, runtime=rt, http=http, drain=drain, transport=transport)
        rt.on_batch = node.metrics.record_batch
        node.chains = ChainHost(node)
        if transport is None:  # hop streams need real sockets; a test transport keeps hops on HTTP
            node.streams = StreamPool(node.chains.dispatch, connect_timeout_s=settings.hop_connect_timeout_s,
                                      send_timeout_s=settings.hop_timeout_s)
            node.metrics.count_streams(node.streams.traffic)
        app.state.node = node
        drain.idle = lambda: hop_sessions_idle(node)
        agent_task = None
        if not settings.tracker_url and settings.model and settings.shard:
            from meshnet.node.loader import load_shard
            await load_shard(node, settings.model, settings.shard, "pinned")
        if settings.tracker_url and start_agent:
            agent_task = await _start_agent(node, drain)
        try:
            yield node
        finally:
            await node.chains.close()
            if node.streams is not None:
                await node.streams.close()
            if agent_task is not None:  # the agent this lifespan started (tests may set their own)
                agent_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await agent_task
                await node.agent.close()


async def _start_agent(node: NodeContext, drain: Drain) -> asyncio.Task:
    """Register ``node`` with its tracker and start its heartbeat loop; the drain announces and
    leaves through it. Returns the loop's task."""
    from meshnet.node.agent import TrackerAgent

    node.agent = TrackerAgent(node)
    node.step_key = node.agent.key
    try:
        await node.agent.start()
    except BaseException:
        await node.agent.close()  # its relay tunnel, if it opened one
        raise
    drain.announce, drain.leave = node.agent.announce_drain, node.agent.leave
    return asyncio.create_task(node.agent.run())


def _offer_relay(app: Starlette) -> None:
    """Relay other nodes' traffic here (``--offer-relay``, ADR-0045): a node attaches for its own id
    only, signed with the key the tracker has bound to it."""
    from meshnet.relay.auth import KeyedAuthorize
    from meshnet.relay.hub import DEFAULT_RELAY_BODY_BYTES, RelayHub

    async def key_of(node_id: str) -> str | None:
        agent = app.state.node.agent
        if agent is None:
            raise NotFound("this node has no tracker to check relayed nodes' keys with", code="relay_unavailable")
        return await agent.client.node_key(node_id)

    app.state.relay = hub = RelayHub(KeyedAuthorize(key_of), max_body_bytes=DEFAULT_RELAY_BODY_BYTES)
    app.router.routes.extend(hub.routes())
