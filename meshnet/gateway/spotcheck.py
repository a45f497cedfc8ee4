"""Spot-checks: an entry node re-runs a share of hop inputs on other holders (ADR-0042).

With probability ``rate`` per session, the first prefill call of a hop (position 0, so a fresh
session elsewhere computes exactly the same thing) is also sent to a second holder of the
same layers and recipe, under a fresh session id and its own ticket. The two output frames are compared
(:func:`meshnet.dataplane.evidence.frame_distance`). Within ``limit`` they agree and the
generation goes on. Otherwise a third holder (neither of the first two) runs the same input
and the majority decides (:func:`meshnet.dataplane.evidence.outvoted`): the outvoted node is
reported to the tracker for quarantine with the distances as evidence. When the checked hop
itself lost, the caller fails it over (its replacement replays the session), so no answer of
this generation passes through it afterwards.

A range with no second holder cannot be checked: the hop stays unverified (the tracker marks
such hops in its routes). No majority (a second disagreeing holder and no third, or three
different answers) is logged and reported to no one: one node's word against another's is no
evidence.
"""

from __future__ import annotations

import contextlib
import logging
import random
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx

from meshnet.gateway.entry import ActivationCodec
from meshnet.dataplane.hops import post_forward
from meshnet.dataplane.failover import release_soon
from meshnet.layers import LayerRange
from meshnet.dataplane.evidence import frame_distance, outvoted, tolerance
from meshnet.dataplane.frames import FLAG_LAST_ONLY, read_frame
from meshnet.errors import MeshnetError
from meshnet.protocol.control import AuditReport, AuditStep
from meshnet.protocol.route import Hop, Route
from meshnet.protocol.signing import b64url

log = logging.getLogger(__name__)

#: async (model, layers, exclude node ids, session id, like node id) -> a route over ``layers`` through
#: shards of the same recipe as node ``like``'s, with its ticket (``GET /v1/route?like=``)
WitnessRoutes = Callable[[str, LayerRange, frozenset[str], str, str], Awaitable[Route]]
#: async (node id, model, the checked hop, witnesses, distances keyed "a|b", limit, session, ticket,
#: evidence) -> None: asks the tracker to judge the node. ``evidence`` is the outvoted node's own signed
#: step (``POST /v1/nodes/{id}/audit``, ADR-0067), None when it signed none: then nothing can be shown
QuarantineReporter = Callable[[str, str, Hop, list[str], dict[str, float], float, str, "str | None",
                               "AuditReport | None"], Awaitable[None]]
#: seconds a spot-check's session release may take
RELEASE_TIMEOUT_S = 5.0


@dataclass
class SpotCheckStats:
    """What this entry's spot-checks found (its metrics and the benches read them)."""

    checks: int = 0
    unverified: int = 0
    disputes: int = 0
    quarantined: list[str] = field(default_factory=list)  # the latest 100 outvoted nodes
    #: the latest distances measured between two holders (newest last, at most 100: health shows them)
    distances: list[float] = field(default_factory=list)


@contextlib.asynccontextmanager
async def witness_session(routes: WitnessRoutes, client: httpx.AsyncClient, release_auth: httpx.Auth | None,
                          model: str, hop: Hop, exclude: frozenset[str]):
    """A fresh session on one other holder of ``hop.layers`` with ``hop``'s recipe, none in
    ``exclude`` (a spot-check's or an audit's witness): yields ``(witness hop, session id, its
    ticket)``, or None when there is no such single holder (no route, the tracker down, or the
    layers covered only in pieces: no one node to hold to account); the session is released on
    the witness in the background at the end."""
    session = uuid.uuid4().hex
    try:
        route: Route = await routes(model, hop.layers, exclude | {hop.node_id}, session, hop.node_id)
    except Exception as exc:  # noqa: BLE001 - no other holder (NoRoute), tracker down: unverified
        log.debug("no witness for %s layers %s: %s", hop.node_id, hop.layers, exc)
        route = None
    if route is None or len(route.hops) != 1:
        yield None
        return
    try:
        yield route.hops[0], session, route.ticket
    finally:
        release_soon(client, [(route.hops[0].endpoint, route.ticket)], session, RELEASE_TIMEOUT_S, release_auth)


class SpotChecker:
    """Decides which hop calls to check and runs the checks.

    Args:
        rate: probability that one session is checked (0 disables; default 0.02).
        client: httpx client for the extra hop calls; ``timeout_s`` bounds each.
        routes: finds witnesses (:data:`WitnessRoutes`): holders of the checked hop's layers
            with its recipe, asked with a fresh session id, so each witness gets its own ticket.
        report: tells the tracker whom to quarantine (:data:`QuarantineReporter`).
        limit: agreement threshold, relative L2 (default: the bfloat16 tolerance).
        release_auth: signs the witnesses' session releases as this entry (None: unsigned).
        rng: the source of the draws (tests pass a seeded one).
    """

    def __init__(self, rate: float, *, client: httpx.AsyncClient, routes: WitnessRoutes,
                 report: QuarantineReporter, limit: float | None = None, timeout_s: float = 60.0,
                 release_auth: httpx.Auth | None = None, rng: random.Random | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"spot-check rate must be within 0..1, got {rate}")
        self.rate, self.client, self.routes, self.report = rate, client, routes, report
        self.limit = tolerance("bfloat16") if limit is None else limit
        self.timeout_s, self.release_auth = timeout_s, release_auth
        self.rng = rng or random.Random()
        self.stats = SpotCheckStats()
        #: nodes this checker found outvoted: never asked to witness again (the tracker also stops routing them)
        self.outvoted: frozenset[str] = frozenset()

    def draw(self) -> bool:
        """Whether to check the session starting now (probability ``rate``)."""
        return self.rate > 0 and self.rng.random() < self.rate

    async def _witness(self, model: str, hop: Hop, exclude: frozenset[str], frame: bytes, last_only: bool,
                       codec: ActivationCodec) -> tuple[str, bytes, str | None, str, str] | None:
        """Run ``frame`` through another holder of ``hop.layers`` (one node, not in ``exclude``) under
        a fresh session; ``(node id, output frame, the ticket naming it, the session, its signed
        receipt or "")``, or None when there is none or it failed."""
        async with witness_session(self.routes, self.client, self.release_auth, model, hop, exclude) as found:
            if found is None:
                return None
            witness, session, ticket = found
            receipts: list[str] = []
            try:
                out, _ = await post_forward(self.client, witness, model=model, session_id=session, position=0,
                                            frame=frame, last_only=last_only, timeout=self.timeout_s, codec=codec,
                                            ticket=ticket, receipts=receipts)
            except Exception as exc:  # noqa: BLE001 - a witness that fails is no evidence either way
                log.info("spot-check witness %s failed: %s", witness.node_id, exc)
                return None
        return witness.node_id, out, ticket, session, receipts[0] if receipts else ""

    def _measure(self, a: bytes, b: bytes) -> float:
        d = frame_distance(a, b)
        self.stats.distances = (self.stats.distances + [d])[-100:]
        return d

    async def check(self, *, model: str, hop: Hop, frame: bytes, output: bytes, last_only: bool,
                    codec: ActivationCodec, session_id: str = "", exclude: frozenset[str] = frozenset(),
                    ticket: str | None = None, receipt: str = "") -> str | None:
        """Check ``hop``'s ``output`` for input ``frame`` (a position-0 call) against other holders,
        none of them in ``exclude`` (the session's failed nodes) or outvoted by this checker before.
        ``ticket``: the session's ticket naming ``hop`` (the report of an outvoted hop carries the
        ticket that named it, ADR-0042); ``receipt``: the hop's signed receipt of ``output`` (the
        evidence the tracker judges by, ADR-0067).

        Returns:
            The node id the vote quarantined (``hop.node_id`` when the checked hop lost, a
            witness's id when it did), or None (agreement, no witness, or no majority).
        """
        self.stats.checks += 1
        exclude = exclude | self.outvoted | {hop.node_id}
        second = await self._witness(model, hop, exclude, frame, last_only, codec)
        if second is None:
            self.stats.unverified += 1
            return None
        second_id, second_out, second_ticket, second_session, second_receipt = second
        d12 = self._measure(output, second_out)
        if d12 <= self.limit:
            return None
        log.warning("spot-check: %s and %s disagree on layers %s (distance %.4f > %.4f)", hop.node_id, second_id,
                    hop.layers, d12, self.limit)
        third = await self._witness(model, hop, exclude | {second_id}, frame, last_only, codec)
        if third is None:
            self.stats.disputes += 1
            log.warning("spot-check: no third holder of layers %s to settle %s against %s", hop.layers,
                        hop.node_id, second_id)
            return None
        third_id, third_out, third_ticket, third_session, third_receipt = third
        distances = {(hop.node_id, second_id): d12, (hop.node_id, third_id): self._measure(output, third_out),
                     (second_id, third_id): self._measure(second_out, third_out)}
        loser = outvoted(hop.node_id, second_id, third_id, distances, self.limit)
        if loser is None:
            self.stats.disputes += 1
            log.warning("spot-check: no majority over layers %s: %s", hop.layers, distances)
            return None
        witnesses = [n for n in (hop.node_id, second_id, third_id) if n != loser]
        evidence = {f"{a}|{b}": round(d, 6) for (a, b), d in distances.items()}
        log.warning("spot-check: %s outvoted over layers %s by %s: %s", loser, hop.layers, witnesses, evidence)
        self.stats.quarantined = (self.stats.quarantined + [loser])[-100:]
        self.outvoted = self.outvoted | {loser}
        named, session, out, signed = {
            hop.node_id: (ticket, session_id, output, receipt),
            second_id: (second_ticket, second_session, second_out, second_receipt),
            third_id: (third_ticket, third_session, third_out, third_receipt)}[loser]
        proof = _evidence(model, hop, session, named, frame, out, signed, last_only)
        try:
            await self.report(loser, model, hop, witnesses, evidence, self.limit, session_id, named, proof)
        except Exception:  # noqa: BLE001 - a lost report must not fail the generation
            log.warning("could not report %s for quarantine", loser, exc_info=True)
        return loser


def _evidence(model: str, hop: Hop, session: str, ticket: str | None, frame: bytes, output: bytes, receipt: str,
              last_only: bool) -> AuditReport | None:
    """The outvoted node's own signed step, as the tracker judges it (ADR-0067): its input at
    position 0 of ``session``, its output and its receipt; None when it signed none."""
    if not receipt or not ticket:
        return None
    start, end = hop.layers.to_inclusive()
    try:
        tokens = read_frame(frame).shape[1]
    except (MeshnetError, IndexError):
        return None
    try:
        return AuditReport(model=model, shard_start=start, shard_end=end, chain_id=session, ticket=ticket, steps=[
            AuditStep(position=0, tokens=tokens, flags=FLAG_LAST_ONLY if last_only else 0, input=b64url(frame),
                      output=b64url(output), receipt=receipt)])
    except ValueError:  # a session id that is no chain id (32 hex characters): nothing the tracker could check
        return None
