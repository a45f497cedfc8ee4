"""The tracker's node-facing API: registration, heartbeats, hop failure, quarantine and audit reports,
a node's own drain and leave, the key bound to a node id; and the background work they start
(reachability probes, admission challenges).

Registration needs the join token when the tracker has one and is signed by the key it
registers; every later node call is signed by the node's bound key (ADR-0035).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from meshnet.errors import Conflict, NotFound
from meshnet.protocol.control import (AuditReplay, AuditReport, FailureReport, HeartbeatRequest, HeartbeatResponse,
                                      QuarantineReport, RegisterRequest, RegisterResponse, check_revision)
from meshnet.dataplane.frames import FLAG_REWIND
from meshnet.protocol.http import validate_json
from meshnet.protocol.signing import HEADER_NODE, HEADER_TIMESTAMP, decode_public_key
from meshnet.tracker import speed
from meshnet.tracker.admission import Challenge, Holder, run_challenge, run_steps
from meshnet.tracker.audit import AuditCase, AuditVerdict, judge_audit, judge_replay, read_replay
from meshnet.tracker.auth import NodeAuth
from meshnet.tracker.probe import answers_as, probe_endpoint
from meshnet.tracker.service import TrackerService

log = logging.getLogger(__name__)


def service_of(request: Request) -> TrackerService:
    """The tracker service behind ``request``'s app."""
    return request.app.state.service


async def probe(app: Starlette, node_id: str, endpoint: str) -> None:
    """Probe one node's endpoint now and record the answer (meshnet.tracker.probe)."""
    svc: TrackerService = app.state.service
    error = await probe_endpoint(app.state.http, endpoint, node_id, svc.settings.probe_timeout_s)
    svc.set_reachability(node_id, endpoint, error)
    start_challenges(app)
    if svc.dirty:
        app.state.wake.set()


async def admit(app: Starlette, challenge: Challenge) -> None:
    """Run one admission challenge and record its verdict (ADR-0042, :mod:`meshnet.tracker.admission`)."""
    svc: TrackerService = app.state.service
    verdict, outvoted = await run_challenge(app.state.http, svc.tickets.key, challenge,
                                            svc.settings.challenge_timeout_s, svc.reference)
    svc.record_challenge(challenge, verdict, outvoted)
    app.state.wake.set()


def _in_background(app: Starlette, work) -> None:
    """Run the coroutine ``work`` as a task the app keeps until it ends (its challenges and probes)."""
    running: set[asyncio.Task] = app.state.challenging
    task = asyncio.create_task(work)
    running.add(task)
    task.add_done_callback(running.discard)


def start_challenges(app: Starlette) -> None:
    """Start the admission challenges the service decided on, in the background."""
    for challenge in app.state.service.take_challenges():
        _in_background(app, admit(app, challenge))


async def probe_speed(app: Starlette, holder: Holder, model: str, hidden_size: int) -> None:
    """Time one decode step through ``holder``'s shard and record it (ADR-0068,
    :mod:`meshnet.tracker.speed`); a failed probe records nothing but its time."""
    svc: TrackerService = app.state.service
    try:
        tokens_per_s = await speed.probe_tokens_per_s(app.state.http, svc.tickets.key, holder, model, hidden_size,
                                                      svc.settings.challenge_timeout_s)
    except Exception as exc:  # noqa: BLE001 - refused, timed out, an error answer: no figure this time
        log.info("speed probe of %s on %s %s failed: %s: %s", holder.node_id, model, holder.layers,
                 type(exc).__name__, exc)
        tokens_per_s = None
    svc.record_speed_probe(holder.node_id, model, holder.layers, tokens_per_s)


def start_speed_probes(app: Starlette) -> None:
    """Start the speed probes that are due (:meth:`TrackerService.take_speed_probes`), in the background."""
    for holder, model, hidden_size in app.state.service.take_speed_probes():
        _in_background(app, probe_speed(app, holder, model, hidden_size))


def probe_soon(app: Starlette, node_id: str, endpoint: str) -> None:
    """Probe in the background, at most one probe per node at a time."""
    probing: dict[str, asyncio.Task] = app.state.probing
    if node_id not in probing:
        probing[node_id] = task = asyncio.create_task(probe(app, node_id, endpoint))
        task.add_done_callback(lambda _: probing.pop(node_id, None))


def _reachability(node) -> dict:
    return {"reachable": node.reachable, "reach_error": node.reach_error}


def _target(request: Request) -> str:
    """The path and query string a node signed."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


async def public_key(svc: TrackerService, node_id: str) -> str | None:
    """:meth:`TrackerService.public_key` for the event loop: a key not held in memory yet is read
    from the store on a worker thread (a database that stalls never holds the loop)."""
    key = svc.known_key(node_id)
    return key if key is not None else await asyncio.to_thread(svc.public_key, node_id)


async def signed_by(request: Request, body: bytes, *, as_node: str | None = None) -> str:
    """The id of the registered node whose key signed this call (ADR-0035).

    Raises:
        Unauthorized (401), Forbidden (403), NotFound (404): see :meth:`NodeAuth.verify_node_call`.
    """
    auth: NodeAuth = request.app.state.auth
    claimed = request.headers.get(HEADER_NODE, "")
    key = await public_key(service_of(request), claimed) if claimed else None
    return auth.verify_node_call(key, request.headers, request.method, _target(request), body, as_node=as_node)


def _read_registration(request: Request, body: bytes) -> RegisterRequest:
    """Join token, protocol revision, fields, then the signature by the key being registered."""
    auth: NodeAuth = request.app.state.auth
    auth.check_join_token(request.headers)
    try:
        check_revision(json.loads(body or b"{}"))
    except (ValueError, RecursionError):
        pass  # not JSON: validate_json says so
    payload = validate_json(RegisterRequest, body)
    auth.verify_registration(payload, request.headers, request.method, _target(request), body)
    return payload


async def refuse_a_second_live_process(app: Starlette, payload: RegisterRequest) -> None:
    """A registration with a node's own key from another endpoint while the node's recorded
    endpoint still answers as that node is a second live process with one identity (a cloned
    machine image): refused, so the record stays with the process that holds it. A node that moved
    (its old endpoint is silent, or answers as someone else) registers as usual.

    Raises:
        Conflict (409 ``node_id_in_use``): the recorded endpoint answered as the node just now.
    """
    svc: TrackerService = app.state.service
    known = svc.nodes.get(payload.node_id)
    if known is None or known.endpoint == payload.endpoint:
        return  # new, or the same endpoint again
    if await public_key(svc, payload.node_id) != payload.public_key:
        return  # another key: refused as an impostor by the service
    if await answers_as(app.state.http, known.endpoint, payload.node_id, svc.settings.probe_timeout_s):
        raise Conflict(f"node {payload.node_id} runs already at {known.endpoint} (it answered just now): a second "
                       f"process with its identity is refused", code="node_id_in_use",
                       hint="stop the other process (or give this one its own --node-id and --state-dir)")


async def register(request: Request) -> JSONResponse:
    """Register a node, then probe its endpoint once before answering: its shards are admitted only
    once the tracker has reached it (a node that registers before it listens is probed again)."""
    svc = service_of(request)
    payload = _read_registration(request, await request.body())
    await refuse_a_second_live_process(request.app, payload)
    # the store's part on worker threads (a database that stalls never holds the event loop), the
    # registrations that arrive together in one transaction each (ADR-0063)
    bound = svc.known_key(payload.node_id)
    if bound != payload.public_key:
        bound = await request.app.state.binding.submit((payload.node_id, payload.public_key))
    record, old, row = svc.begin_register(payload, float(request.headers[HEADER_TIMESTAMP]), bound)  # verified
    saved, pins = await request.app.state.registering.submit((record.node_id, row))
    svc.end_register(record, old, saved, pins)
    await probe(request.app, record.node_id, record.endpoint)
    request.app.state.wake.set()
    return JSONResponse(RegisterResponse(node_id=record.node_id, heartbeat_interval_s=svc.announce_interval(record),
                                         tracker_key=svc.tickets.public_key, **_reachability(record)).model_dump())


async def heartbeat(request: Request) -> JSONResponse:
    svc = service_of(request)
    node_id = request.path_params["node_id"]
    body = await request.body()
    await signed_by(request, body, as_node=node_id)
    write = svc.begin_heartbeat(node_id, validate_json(HeartbeatRequest, body),
                                sent_at=float(request.headers[HEADER_TIMESTAMP]))  # verified just now
    directives = []
    if write.needs_store:  # on a worker thread: a database that stalls never holds the event loop
        try:
            directives = await asyncio.to_thread(svc.heartbeat_store, write)
        except BaseException:
            svc.undo_heartbeat(write)
            raise
    start_challenges(request.app)
    if svc.dirty:
        request.app.state.wake.set()
    node = svc.get(node_id)
    return JSONResponse(HeartbeatResponse(directives=directives, heartbeat_interval_s=svc.announce_interval(node),
                                          **_reachability(node)).model_dump(mode="json"))


async def failure(request: Request) -> JSONResponse:
    """A hop failure report, signed by the entry node that saw it: recorded (routes avoid the node
    a while) and the node probed again. Only a node that could have routed through the reported
    one counts (403 otherwise, nothing recorded)."""
    raw = await request.body()
    sender = await signed_by(request, raw)
    body = validate_json(FailureReport, raw)
    svc = service_of(request)
    node_id = request.path_params["node_id"]
    svc.report_failure_from(sender, node_id, body.reason, body.ticket)
    probe_soon(request.app, node_id, svc.nodes[node_id].endpoint)
    return JSONResponse({"ok": True})


async def quarantine(request: Request) -> JSONResponse:
    """A spot-check's verdict, signed by the entry node that ran it: the tracker re-counts the vote
    and quarantines the node (ADR-0042); 403 from a node that could not have routed through it,
    422 ``weak_evidence`` when the evidence does not outvote it."""
    raw = await request.body()
    sender = await signed_by(request, raw)
    record = service_of(request).quarantine_from(sender, request.path_params["node_id"],
                                           validate_json(QuarantineReport, raw))
    request.app.state.wake.set()
    return JSONResponse({"node_id": record.node_id, "quarantine": record.to_json()})


async def audit(request: Request) -> JSONResponse:
    """An entry's audit of a hop, signed by the entry, with the hop's own signed steps as evidence:
    the tracker re-runs them on holders it picks and decides (ADR-0067, :mod:`meshnet.tracker.audit`).
    200 with ``{"verdict", "reason", "distances"}``: ``quarantine``, ``false_accusation``,
    ``witness_outvoted``, ``replay_outvoted`` (the entry's own witness signed a replay the others
    outvote) or ``inconclusive``; 403 from a node that did not have the accused on that chain's route; 422
    ``forged_evidence`` when the accused did not sign the steps (the sender is quarantined)."""
    raw = await request.body()
    sender = await signed_by(request, raw)
    report = validate_json(AuditReport, raw)
    svc = service_of(request)
    node_id = request.path_params["node_id"]
    key = await public_key(svc, node_id)
    if key is None:
        raise NotFound(f"unknown node {node_id!r}", code="unknown_node")
    case = svc.audit_case(sender, node_id, report, decode_public_key(key))
    runs = await rerun(request.app, case)
    verdict = judge_audit(case, runs)
    if verdict.state == "false_accusation" and report.replay is not None:
        verdict = await weigh_replay(svc, case, report.replay, runs, verdict)
    svc.apply_audit(case, verdict)
    svc.metrics.audit_verdicts.labels(verdict=verdict.state).inc()
    request.app.state.wake.set()
    return JSONResponse({"node_id": node_id, **verdict.to_json()})


async def weigh_replay(svc: TrackerService, case: AuditCase, replay: AuditReplay, runs: dict[str, list[bytes]],
                       verdict: AuditVerdict) -> AuditVerdict:
    """``verdict`` (a false accusation) after the entry's witness's signed replay is weighed
    (:func:`meshnet.tracker.audit.judge_replay`); a replay its witness did not sign leaves it as it is."""
    text = await public_key(svc, replay.witness)
    if text is None:
        steps, why = [], f"names {replay.witness}, a node the tracker does not know"
    else:
        steps, why = read_replay(replay, case.model, case.layers, decode_public_key(text))
    if why:
        return dataclasses.replace(verdict, reason=f"{verdict.reason}; the entry's replay does not stand: {why}")
    return judge_replay(case, steps, replay.witness, runs, verdict)


async def rerun(app: Starlette, case: AuditCase) -> dict[str, list[bytes]]:
    """Each witness's run of the case's inputs (node id -> its output frames; one that failed is
    left out), the witnesses run side by side."""
    svc: TrackerService = app.state.service
    steps = [(s.position, s.frame_in, bool(s.flags & FLAG_REWIND)) for s in case.steps]

    async def one(witness):
        try:
            return witness.node_id, await run_steps(app.state.http, svc.tickets.key, witness, case.model, case.layers,
                                                    steps, svc.settings.challenge_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a witness that fails is no evidence either way
            log.info("audit witness %s failed: %s: %s", witness.node_id, type(exc).__name__, exc)
            return witness.node_id, None

    done = await asyncio.gather(*(one(w) for w in case.witnesses))
    return {node_id: frames for node_id, frames in done if frames is not None}


async def drain_node(request: Request) -> JSONResponse:
    """A node's own announcement that it drains: no new routes or entry choices through it."""
    await signed_by(request, await request.body(), as_node=request.path_params["node_id"])
    node = service_of(request).drain(request.path_params["node_id"])
    request.app.state.wake.set()
    return JSONResponse({"node_id": node.node_id, "draining": True})


async def deregister(request: Request) -> JSONResponse:
    """A node leaving on purpose (end of its drain): forgotten now, not after the heartbeat timeout."""
    node_id = request.path_params["node_id"]
    await signed_by(request, await request.body(), as_node=node_id)
    await service_of(request).deregister_off_loop(node_id)
    request.app.state.wake.set()
    return JSONResponse({"node_id": node_id, "deregistered": True})


async def node_key(request: Request) -> JSONResponse:
    """The public key bound to a node id (public: it proves nothing by itself). A node offering a
    relay checks a tunnel's signature with it (ADR-0045).

    Raises:
        NotFound (404 ``unknown_node``): the id was never registered.
    """
    node_id = request.path_params["node_id"]
    key = await public_key(service_of(request), node_id)
    if key is None:
        raise NotFound(f"unknown node {node_id!r}: no key is bound to it", code="unknown_node",
                       hint="see `meshnet nodes` for node ids")
    return JSONResponse({"node_id": node_id, "public_key": key})
