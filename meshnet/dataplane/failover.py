"""The failover core both remote-hop drivers of a session run: the chain of hop streams
(:class:`meshnet.dataplane.chain.ChainRoute`) and the HTTP path (:class:`meshnet.dataplane.hops.RemoteRoute`).

:class:`Failover` holds one session's decisions: which hops are excluded and which are
reported (a busy hop or one that only lost the session is neither reported nor, for the
latter, excluded), the replacement route over a failed range, the releases of hops left behind,
the liveness probe of a hop that missed its deadline (ADR-0036) and the deadline itself
(:mod:`meshnet.dataplane.deadlines`: a driver asks ``deadline_s(fo.policy, times, tokens)``);
the replay goes through :func:`meshnet.dataplane.replay.rechunk`.
A driver only says when a step failed and what it sends where.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import httpx

from meshnet.dataplane.deadlines import DeadlinePolicy, StepTimes
from meshnet.errors import HEALTHY_HOP_CODES, HopBusy, HopFailed
from meshnet.dataplane.codec import ActivationCodec
from meshnet.layers import LayerRange
from meshnet.protocol.ids import ModelName, NodeId, SessionId
from meshnet.protocol.route import Hop, Route
from meshnet.protocol.tickets import HEADER_TICKET

log = logging.getLogger(__name__)


#: async (model, layers, exclude node ids, session id) -> hops covering exactly ``layers`` and their ticket
RouteProvider = Callable[[ModelName, LayerRange, frozenset[NodeId], SessionId], Awaitable[Route]]
#: async (node id, reason) -> None; tells the tracker a hop failed
FailureReporter = Callable[[NodeId, str, "str | None"], Awaitable[None]]
#: (failed hop, its replacement hops, why it failed) -> None; told after each failover (the traffic log)
FailoverListener = Callable[[Hop, list[Hop], str], None]


#: seconds a release of a hop still in the route may take (it answered a moment ago)
RELEASE_TIMEOUT_S = 5.0
#: seconds a release of an excluded hop may wait: a frozen node that resumes within it frees the
#: session at once instead of holding it until its TTL (300 s); nothing waits for it meanwhile
ABANDONED_RELEASE_TIMEOUT_S = 60.0

#: first pause before a release whose connection broke is sent again, seconds (doubling up to
#: :data:`RELEASE_RETRY_MAX_S`: a dead node costs a handful of refused connections, not a stream)
RELEASE_RETRY_S, RELEASE_RETRY_MAX_S = 0.25, 4.0

_releases: set[asyncio.Task] = set()  # releases in flight (kept referenced until they end)


@dataclass(frozen=True)
class MeshLink:
    """How an entry node reaches the mesh: its HTTP ``client``, the tracker's ``routes`` and failure
    ``report`` callbacks, and ``release_auth``, which signs session releases as the entry
    (ADR-0038; None: unsigned)."""

    client: httpx.AsyncClient
    routes: RouteProvider
    report: FailureReporter
    release_auth: httpx.Auth | None = None


@dataclass(frozen=True)
class RemoteContext:
    """What the remote hops of one session need from their entry.

    Attributes:
        link: the entry's :class:`MeshLink`; ``model``: the model's name (``X-Meshnet-Model``).
        codec: activations to and from frames (the entry's :class:`ActivationCodec`).
        timeout_s: the longest a step may take while its hops answer probes, seconds (the ceiling
            for a slow but live hop); ``connect_timeout_s``: to connect to a hop, seconds.
        max_failovers: replacements per step before giving up.
        deadlines: when a step is late enough to probe its hops (:class:`DeadlinePolicy`, ADR-0036).
        replay_chunk_tokens: tokens per replay chunk to a replacement (the prefill chunk, 128).
    """

    link: MeshLink
    model: str
    codec: ActivationCodec
    timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    max_failovers: int = 3
    deadlines: DeadlinePolicy = DeadlinePolicy()
    replay_chunk_tokens: int = 128


_reports: set[asyncio.Task] = set()  # failure reports in flight (kept referenced until they end)


async def report_failure(report: FailureReporter, node_id: NodeId, reason: str, ticket: str | None = None) -> None:
    """Tell the tracker that ``node_id`` failed, with the session ``ticket`` whose route named it
    (the tracker counts only such a report); a lost report is logged, never raised (it must not
    fail the generation)."""
    try:
        await report(node_id, reason, ticket)
    except Exception:  # noqa: BLE001 - a lost report must not fail the generation
        log.warning("could not report the failure of %s", node_id, exc_info=True)


def report_soon(report: FailureReporter, node_id: NodeId, reason: str, ticket: str | None = None) -> None:
    """:func:`report_failure` in the background: the new route is asked for at once."""
    task = asyncio.get_running_loop().create_task(report_failure(report, node_id, reason, ticket))
    _reports.add(task)
    task.add_done_callback(_reports.discard)


#: where a session was opened: ``(endpoint, ticket naming that node or None)``
Touched = tuple[str, "str | None"]


async def _delete_session(client: httpx.AsyncClient, endpoint: str, ticket: str | None, session_id: SessionId,
                          timeout_s: float, auth: httpx.Auth | None) -> None:
    """``DELETE {endpoint}/v1/sessions/{session_id}`` within ``timeout_s`` seconds in all. A
    connection that breaks before the answer (a reset or closed keep-alive connection, often one a
    frozen node's probe left behind) is not the end, unlike a refused one (nobody listens): the release is sent again on a fresh one,
    after :data:`RELEASE_RETRY_S` and then twice as long each time, until it is answered or the
    time is up. A frozen node then finds it waiting in its socket when it resumes."""
    headers = {HEADER_TICKET: ticket} if ticket else {}
    deadline, pause = time.monotonic() + timeout_s, RELEASE_RETRY_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            async with asyncio.timeout(left):  # in-process transports ignore httpx's own timeout
                await client.delete(f"{endpoint}/v1/sessions/{session_id}", timeout=left, headers=headers,
                                    **({"auth": auth} if auth is not None else {}))
            return
        except (httpx.TimeoutException, TimeoutError, httpx.ConnectError):  # out of time, or nobody listens
            break
        except httpx.TransportError:  # a connection broke after it was made: send it again on a fresh one
            log.debug("release of session %s at %s: connection broke, sending again", session_id, endpoint,
                      exc_info=True)
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, RELEASE_RETRY_MAX_S)
        except Exception:  # noqa: BLE001 - best effort: the hop's TTL expires the session
            break
    log.debug("could not release session %s at %s within %.0f s", session_id, endpoint, timeout_s)


def release_soon(client: httpx.AsyncClient, touched: list[Touched], session_id: SessionId, timeout_s: float,
                 auth: httpx.Auth | None = None) -> None:
    """Start ``DELETE {endpoint}/v1/sessions/{session_id}`` on each ``(endpoint, ticket)`` in the
    background and return at once (never raises, never waits: a frozen node must not hold up
    anyone). ``timeout_s``: how long each release may wait for its answer, seconds; ``auth``
    signs the release as the entry node (ADR-0038; None: unsigned)."""
    loop = asyncio.get_running_loop()
    for endpoint, ticket in touched:
        task = loop.create_task(_delete_session(client, endpoint, ticket, session_id, timeout_s, auth))
        _releases.add(task)
        task.add_done_callback(_releases.discard)


async def settle_releases(timeout_s: float) -> None:
    """Wait up to ``timeout_s`` seconds for the background releases of this event loop to end
    (tests; a service that wants its releases sent before it closes its client)."""
    loop = asyncio.get_running_loop()
    pending = [t for t in _releases if t.get_loop() is loop]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)


async def probe_hop(client: httpx.AsyncClient, hop: Hop, limit_s: float, chain_id: SessionId | None = None) -> bool | None:
    """The liveness probe of a hop that missed its deadline (ADR-0036): ``GET /v1/health`` within
    ``limit_s`` seconds. None: no answer in time (refused, reset, silent). Otherwise True, or
    False when asked about hop stream chain ``chain_id`` and the node answers that it does not
    hold it (ADR-0040; a node that does not say is taken to hold it)."""
    try:
        async with asyncio.timeout(limit_s):
            resp = await client.get(f"{hop.endpoint}/v1/health", timeout=limit_s,
                                    params=None if chain_id is None else {"chain": chain_id})
    except Exception:  # noqa: BLE001 - no answer in time, refused, reset: not alive
        return None
    if chain_id is None:
        return True
    try:
        body = resp.json()
    except ValueError:  # alive, but not a JSON answer (a proxy's error page): nothing known of the chain
        return True
    return not (isinstance(body, dict) and body.get("chain") is False)


#: the code of a hop that answers its probe but no longer holds the chain: kept out of this
#: session's new routes, not reported (it may be healthy: restarted, or unable to reach the entry)
CHAIN_LOST = "chain_lost"


def describe(hop: Hop) -> str:
    """A hop as error messages name it: node, endpoint and layers."""
    return f"hop {hop.node_id} at {hop.endpoint} (layers {hop.layers})"


class Failover:
    """One session's failover state and decisions, whichever driver runs its hops.

    Args:
        ctx: the entry's link to the mesh and hop settings (:class:`RemoteContext`).
        session_id: the id new routes and tickets are asked for (a chain's current id for the chain).
        on_failover: told of each failed hop and its replacement hops (the traffic log, ADR-0046;
            None: nobody).

    Attributes:
        failed: node ids excluded from this session's routes (failed or busy).
        failovers: replacements made; ``deadline_misses``: of those, for a hop that froze.
    """

    def __init__(self, ctx: RemoteContext, session_id: SessionId, on_failover: FailoverListener | None = None) -> None:
        self.ctx, self.session_id, self.on_failover = ctx, session_id, on_failover
        self.link, self.policy = ctx.link, ctx.deadlines
        self.failed: set[str] = set()
        self.failovers = 0
        self.deadline_misses = 0
        #: whether each route the session used was verified by the tracker (ADR-0069), in order
        self.routes_verified: list[bool | None] = []

    def new_times(self) -> StepTimes:
        """Step times of a new hop or chain, for its deadlines."""
        return StepTimes(self.policy.ema_alpha)

    def exclude(self, exc: HopFailed, ticket: str | None = None) -> bool:
        """Keep the hop ``exc`` names out of this session's new routes and report it to the tracker
        in the background (the new route is asked for at once). Not reported: a busy hop (healthy,
        503) or one that lost the chain; neither reported nor excluded: a hop that lost the
        session or refused an expired ticket (the replay, after a new route and ticket, restarts
        the session on it). ``ticket``: the session ticket whose route named the hop, sent with the
        report. Returns whether the hop was excluded."""
        if exc.node_id is None or exc.code in HEALTHY_HOP_CODES:
            return False
        self.failed.add(exc.node_id)
        if not isinstance(exc, HopBusy) and exc.code != CHAIN_LOST:
            report_soon(self.link.report, exc.node_id, exc.message, ticket)
        return True

    async def new_route(self, layers: LayerRange, exc: HopFailed, session_id: SessionId | None = None) -> Route:
        """A route over ``layers`` without the excluded nodes, with a fresh ticket for ``session_id``
        (default: the session's id).

        Raises:
            HopBusy, HopFailed: ``exc`` (its class kept) extended with why there is none.
        """
        try:
            route = await self.link.routes(self.ctx.model, layers, frozenset(self.failed), session_id or self.session_id)
        except Exception as route_exc:  # noqa: BLE001 - no route, tracker down, bad answer
            why = getattr(route_exc, "message", None) or f"{type(route_exc).__name__}: {route_exc}"
            cls = HopBusy if isinstance(exc, HopBusy) else HopFailed
            raise cls(f"{exc.message}; no other route: no other node serves layers {layers}: {why}",
                      node_id=exc.node_id, code=exc.code) from route_exc
        self.routes_verified.append(route.verified)
        return route

    def release(self, touched: list[Touched], session_id: SessionId, *, abandoned: bool) -> None:
        """Release ``session_id`` on each ``(endpoint, ticket)`` in the background; an ``abandoned``
        one (a hop left behind by a failover) is given longer, so a frozen node that resumes frees
        it at once."""
        if touched:
            timeout_s = ABANDONED_RELEASE_TIMEOUT_S if abandoned else RELEASE_TIMEOUT_S
            release_soon(self.link.client, touched, session_id, timeout_s, self.link.release_auth)

    async def probe(self, hops: list[Hop], chain_id: SessionId | None = None) -> tuple[list[Hop], list[Hop]]:
        """``(silent, lost)``: the hops that do not answer ``GET /v1/health`` within the probe
        timeout, and (asked about ``chain_id``) those that answer that they do not hold it."""
        limit = self.policy.probe_timeout_s
        answers = await asyncio.gather(*(probe_hop(self.link.client, h, limit, chain_id) for h in hops))
        return [h for h, a in zip(hops, answers) if a is None], [h for h, a in zip(hops, answers) if a is False]

    def frozen(self, hop: Hop, deadline: float, tokens: int) -> HopFailed:
        """The failure of ``hop``, which missed a ``deadline`` second deadline on ``tokens`` token(s)
        and then its liveness probe (the driver counts it in ``deadline_misses`` once per failover)."""
        return HopFailed(f"{describe(hop)} missed its {deadline:.2f} s deadline on {tokens} token(s) and did not "
                         f"answer a liveness probe within {self.policy.probe_timeout_s:.2f} s (frozen)",
                         node_id=hop.node_id)

    def replaced(self, failed: Hop, replacement: list[Hop], why: str) -> None:
        """Count one failover and tell ``on_failover`` (a listener's error is logged, never raised)."""
        self.failovers += 1
        if self.on_failover is None:
            return
        try:
            self.on_failover(failed, replacement, why)
        except Exception:  # noqa: BLE001 - bookkeeping must not fail the generation
            log.warning("failover listener failed", exc_info=True)


class FailoverCounts:
    """What a hop driver (``fo``: its :class:`Failover`) reports of its session's failovers."""

    fo: Failover

    @property
    def failed(self) -> set[str]:
        """Node ids excluded from this session's routes (failed or busy)."""
        return self.fo.failed

    @property
    def failovers(self) -> int:
        """Replacements made."""
        return self.fo.failovers

    @property
    def deadline_misses(self) -> int:
        """Replacements of a hop that froze (missed its deadline, then its probe)."""
        return self.fo.deadline_misses

    @property
    def verified(self) -> bool | None:
        """Whether the tracker verified every route the session used, failovers' included (ADR-0069;
        None: a route did not say)."""
        said = self.fo.routes_verified
        return None if not said or None in said else all(said)
