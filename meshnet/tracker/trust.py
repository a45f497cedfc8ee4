"""The tracker's trust decisions over its node records (ADR-0042), part of :class:`TrackerService`.

Admission by evidence (each passed capability report gets a verification: the pure decision
is :func:`meshnet.tracker.admission.decide`, the calls :func:`meshnet.tracker.admission.run_challenge`),
audits (an entry's evidence re-run by holders the tracker picks, :mod:`meshnet.tracker.audit`, ADR-0067)
and quarantine. Kept apart from the service's registry, coverage and routing so that each file reads as one
concept; the state lives on the service (``verdicts``, ``digests``, ``challenges``, ``quarantined``,
``accusations``).
"""

from __future__ import annotations

import json
import logging
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from meshnet.protocol.ids import NodeId
from meshnet.errors import Forbidden, InvalidRequest, Unauthorized
from meshnet.presets import canonical_model_name, find_preset
from meshnet.protocol.control import AuditReport, QuarantineReport
from meshnet.protocol.tickets import read_ticket
from meshnet.dataplane.evidence import audit_tolerance
from meshnet.tracker.admission import ADMITTING, SOURCE, Challenge, Holder, Verdict, decide, digest_key
from meshnet.tracker.audit import FALSE_ACCUSATIONS, FORGED, REPLAY_OUTVOTED, WITNESSES, AuditCase, AuditVerdict, \
    read_evidence
from meshnet.tracker.quarantine import Quarantine
from meshnet.tracker.registry import NodeRecord, ShardRecord

log = logging.getLogger(__name__)


def may_report_failure(sender: NodeRecord | None, reported: NodeRecord) -> str:
    """Why ``sender`` may not report a hop failure (or a spot-check verdict) of ``reported``
    ("" when it may).

    Hop failures are reported by entry nodes, which drive routes. So a report counts only from a
    registered node other than the reported one that holds an entry shard of a model the reported
    node serves: one that could have had it on a route.
    """
    if sender is None:
        return "the sender is not a registered node"
    if sender.node_id == reported.node_id:
        return "a node does not report itself"
    models = {s.model for s in reported.shards}
    if not any(s.entry and s.model in models for s in sender.shards):
        return "the sender holds no entry shard of a model the reported node serves"
    return ""


#: how long after its ticket expired a report of a hop that ticket named still counts, seconds
REPORT_GRACE_S = 300.0


def ticket_names(token: str, tracker_key: Ed25519PublicKey, sender: str, accused: str, model: str | None = None,
                 now: float | None = None, session: str | None = None) -> str:
    """Why the session ticket ``token`` does not show that ``sender`` had ``accused`` on a route
    ("" when it does): the ticket must verify with this tracker's key (expired at most
    :data:`REPORT_GRACE_S` ago), be issued to ``sender`` and name ``accused`` among its hops (and be
    for ``model`` and chain ``session``, when given). A report without such a ticket is hearsay: any entry of a model
    could otherwise accuse any of its holders."""
    if not token:
        return "the report carries no session ticket naming the node"
    try:
        claims = read_ticket(token, tracker_key, now=(time.time() if now is None else now) - REPORT_GRACE_S)
    except Unauthorized as exc:
        return f"its ticket is not one this tracker issued, or has expired ({exc.message})"
    if claims.entry != sender:
        return f"its ticket was issued to {claims.entry}, not to {sender}"
    if accused not in {h.node_id for h in claims.hops}:
        return f"its ticket's route does not name {accused}"
    if model is not None and canonical_model_name(claims.model) != canonical_model_name(model):
        return f"its ticket is for {claims.model}, not {model}"
    if session is not None and claims.session != session:
        return f"its ticket is for session {claims.session}, not {session}"
    return ""


def _stored_quarantine(node_id: str, text: str, fallback: Quarantine) -> Quarantine:
    """The quarantine a store row holds (its record as JSON text), or ``fallback`` when this
    version cannot read it: a stored quarantine keeps its node out either way."""
    try:
        return Quarantine.from_json(node_id, json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("unreadable stored quarantine of %s (kept as a quarantine): %s", node_id, exc)
        return fallback


class TrustMixin:
    """Admission verdicts and quarantines of :class:`meshnet.tracker.service.TrackerService`
    (which provides ``nodes``, ``store``, ``settings``, ``reference``, ``admitted_shards``, ``get`` and
    ``dirty``)."""

    @staticmethod
    def _verdict_key(node: NodeRecord, shard: ShardRecord) -> tuple:
        return (node.node_id, shard.model, shard.layers.start, shard.layers.end, shard.report.timestamp)

    @staticmethod
    def _holder(node: NodeRecord, shard: ShardRecord) -> Holder:
        return Holder(node.node_id, node.endpoint, shard.layers, shard.quantization,
                      shard.report.recipe.compute_dtype if shard.report is not None else "")

    def _digest_key(self, shard: ShardRecord) -> tuple:
        return digest_key(shard.model, shard.layers, shard.quantization, shard.report.recipe.compute_dtype) + (
            shard.entry,)

    def _known_digest(self, shard: ShardRecord) -> str | None:
        """The weights digest known for the shard's model, range and recipe: this tracker's, else
        the store's (learnt before a restart, or by another tracker of a shared database)."""
        key = self._digest_key(shard)
        if key not in self.digests:
            stored = self.store.known_digest(json.dumps(key))
            if stored is None:
                return None
            self.digests[key] = stored
        return self.digests[key]

    def _learn_digest(self, shard: ShardRecord, digest: str) -> None:
        """Know ``digest`` for the shard's key unless a digest is known for it (kept in the store)."""
        key = self._digest_key(shard)
        if key not in self.digests:
            self.digests[key] = self.store.learn_digest(json.dumps(key), digest)

    def _anchor_digest(self, anchor: NodeRecord, shard: ShardRecord, digest: str) -> None:
        """A trusted node's ``digest`` becomes the one known for its shard's model, range and recipe
        (ADR-0069): an untrusted node that got there first with another digest no longer sets the
        bar, and the holders of that key whose digest differs are decided again now (rejected)."""
        key = self._digest_key(shard)
        if self._known_digest(shard) == digest:
            return
        self.store.anchor_digest(json.dumps(key), digest)
        self.digests[key] = digest
        for other in list(self.nodes.values()):
            if other is anchor:
                continue
            stale = [self._verdict_key(other, s) for s in other.shards
                     if s.report is not None and s.report.weights_digest not in ("", digest)
                     and self._digest_key(s) == key]
            if stale:
                for verdict_key in stale:
                    self.verdicts.pop(verdict_key, None)
                self.verify_shards(other)
                self.dirty = True

    def trust(self, node_id: str, trusted: bool = True) -> bool:
        """Mark ``node_id`` as trusted by the operator, or no longer (ADR-0069), kept in the store (it
        outlives restarts and is the standby trackers' too); its shards are decided again now.
        Returns whether that changed anything.

        Raises:
            NotFound: no such registered node, when trusting one.
        """
        if trusted:
            self.get(node_id)
        changed = self.store.trust_node(node_id, trusted)
        node = self.nodes.get(node_id)
        if changed and node is not None:
            self.verdicts = {k: v for k, v in self.verdicts.items() if k[0] != node_id}
            for shard in node.shards:
                shard.verdict = None
            self.verify_shards(node)
            self.dirty = True
            log.info("node %s %s by the operator", node_id, "trusted" if trusted else "no longer trusted")
        return changed

    def verify_shards(self, node: NodeRecord) -> None:
        """Give each passed shard of a reachable ``node`` its verification: a known one, or a new
        decision (:func:`meshnet.tracker.admission.decide`), which may queue a challenge (the
        shard is ``pending`` meanwhile). Forgets the verdicts of reports the node no longer has."""
        current = set()
        for shard in node.shards:
            report = shard.report
            if report is None or not report.passed:
                continue
            key = self._verdict_key(node, shard)
            current.add(key)
            verdict = self.verdicts.get(key)
            if verdict is None and node.reachable:
                verdict = self.verdicts[key] = self._decide(node, shard, key)
            shard.verdict = verdict
        self.verdicts = {k: v for k, v in self.verdicts.items() if k[0] != node.node_id or k in current}

    def _decide(self, node: NodeRecord, shard: ShardRecord, key: tuple) -> Verdict:
        preset = find_preset(shard.model)
        hidden = preset.hidden_size if preset is not None and self.settings.admission_challenges else None
        holders = [self._holder(n, s) for n, s in self.admitted_shards(shard.model) if n.node_id != node.node_id]
        digest = shard.report.weights_digest
        trusted = frozenset(self.store.trusted_nodes())
        source = hidden is not None and self.reference is not None and self.reference.holds(shard.model)
        out = decide(self._holder(node, shard), digest, self._known_digest(shard), holders, hidden, trusted, source)
        if isinstance(out, Verdict):
            if out.state in ADMITTING and digest and node.node_id in trusted:
                self._anchor_digest(node, shard, digest)
            elif out.state in ADMITTING and digest:
                self._learn_digest(shard, digest)
            log.log(logging.WARNING if out.state == "rejected" else logging.INFO, "shard %s %s on %s: %s (%s)",
                    shard.model, shard.layers, node.node_id, out.state, out.reason)
            return out
        self.challenges.append(Challenge(shard.model, shard.layers, self._holder(node, shard), out, hidden, key,
                                         source))
        against = ", ".join(([SOURCE] if source else []) + [h.node_id for h in out])
        return Verdict("pending", f"a challenge against {against} is running")

    def take_challenges(self) -> list[Challenge]:
        """The challenges decided since the last call (the app runs them)."""
        out, self.challenges = self.challenges, []
        return out

    def record_challenge(self, challenge: Challenge, verdict: Verdict, outvoted: str | None = None) -> None:
        """Store a challenge's verdict on the candidate's shard (when that report is still current);
        a reference that the vote outvoted is quarantined on the tracker's own evidence."""
        if challenge.key in self.verdicts:
            self.verdicts[challenge.key] = verdict
            if verdict.state == "failed":  # no evidence either way: decide again at the next heartbeat
                del self.verdicts[challenge.key]
        node = self.nodes.get(challenge.candidate.node_id)
        for shard in node.shards if node is not None else []:
            if shard.report is not None and self._verdict_key(node, shard) == challenge.key:
                shard.verdict = verdict
                if verdict.state == "verified" and shard.report.weights_digest:
                    self._learn_digest(shard, shard.report.weights_digest)
        log.log(logging.WARNING if verdict.state in ("rejected", "failed") else logging.INFO,
                "challenge of %s on %s layers %s: %s (%s)", challenge.candidate.node_id, challenge.model,
                challenge.layers, verdict.state, verdict.reason)
        if outvoted is not None and outvoted in self.nodes and outvoted not in self.quarantined:
            start, end = challenge.layers.to_inclusive()
            record = Quarantine(node_id=outvoted, reported_by="tracker (admission challenge)", model=challenge.model,
                                shard_start=start, shard_end=end,
                                witnesses=tuple(n for n in (challenge.candidate.node_id, *verdict.references)
                                                if n != outvoted),
                                distances=dict(verdict.distances), tolerance=verdict.tolerance or 0.0)
            self._quarantine(record)
            self.store.fail_open(outvoted, "node quarantined: outvoted by an admission challenge")
            log.warning("node %s quarantined: outvoted by an admission challenge (%s)", outvoted, verdict.distances)
        self.dirty = True


    # ---- quarantine (ADR-0042) ------------------------------------------------------

    def _quarantine(self, record: Quarantine) -> Quarantine:
        """Keep ``record`` in the store and apply it; returns the quarantine in force (the store's
        earlier one when another tracker of a shared database quarantined the node first)."""
        stored = self.store.add_quarantine(record.node_id, json.dumps(record.to_json()), record.since)
        record = _stored_quarantine(record.node_id, stored, record)  # unreadable (another version): this one stands
        self.quarantined[record.node_id] = record
        if record.node_id in self.nodes:
            self.nodes[record.node_id].quarantine = record
        return record

    def apply_quarantines(self, stored: dict[str, str]) -> bool:
        """Make the store's quarantines (:meth:`TrackerStore.quarantines`: node id → record JSON) this
        tracker's: at start-up, and each sync round on a shared database, where another tracker may
        have quarantined or reinstated a node. A record that cannot be read (another meshnet
        version) is still a quarantine: the node stays out, under a placeholder record. Returns
        whether anything changed."""
        current: dict[str, Quarantine] = {}
        for node_id, text in stored.items():
            fallback = self.quarantined.get(node_id) or Quarantine(
                node_id=node_id, reported_by="unknown (unreadable record)", model="", shard_start=0, shard_end=0,
                witnesses=(), distances={}, tolerance=0.0)
            current[node_id] = _stored_quarantine(node_id, text, fallback)
        if current == self.quarantined:
            return False
        self.quarantined = current
        for node_id, node in self.nodes.items():
            node.quarantine = current.get(node_id)
        self.dirty = True
        return True

    def quarantine_from(self, sender: str, node_id: str, report: QuarantineReport) -> Quarantine:
        """A spot-check verdict as distances only (ADR-0042's report): no longer evidence (ADR-0067).
        The distances are the entry's own word, so any entry could frame any holder it routed
        through; a quarantine now needs the node's own signed steps, which the tracker re-runs
        (:meth:`audit_case`, ``POST /v1/nodes/{id}/audit``). Nothing changes.

        Raises:
            NotFound: ``node_id`` is not registered.
            Forbidden (403 ``not_on_route``): the sender could not have had it on a route, or the
                report's ticket does not show it had (:func:`ticket_names`).
            InvalidRequest (422 ``weak_evidence``): otherwise.
        """
        accused = self.get(node_id)
        why = may_report_failure(self.nodes.get(sender), accused) or ticket_names(
            report.ticket, self.tickets.key.public_key(), sender, node_id, report.model)
        if why:
            log.warning("refused a quarantine report of %s from %s: %s", node_id, sender, why)
            raise Forbidden(f"{sender} may not report {node_id}: {why}", code="not_on_route")
        log.warning("refused a distances-only quarantine report of %s from %s", node_id, sender)
        raise InvalidRequest(f"distances alone do not quarantine {node_id}: they are {sender}'s word",
                             code="weak_evidence", status=422,
                             hint="send the node's own signed steps to POST /v1/nodes/{id}/audit (ADR-0067); "
                                  "the tracker re-runs them on holders it picks")

    # ---- audits (ADR-0067) ----------------------------------------------------------

    def audit_case(self, sender: str, node_id: str, report: AuditReport, accused_key: Ed25519PublicKey) -> AuditCase:
        """The dispute an entry's audit report opens, ready for the witnesses' runs
        (:mod:`meshnet.tracker.audit`): neither the accused nor the sender, and the witness whose
        replay the report carries only where no other holder is left (three holders of a range: its
        own re-run then answers the replay it signed). Evidence the accused did not sign
        quarantines the sender.

        Raises:
            NotFound: ``node_id`` is not registered.
            Forbidden (403 ``not_on_route``): the sender could not have had it on a route, or the
                ticket does not show it had, for that chain.
            InvalidRequest (422 ``forged_evidence``): a step's receipt does not verify with the
                accused's key (the sender is quarantined); (422 ``no_holding``) the accused holds no
                admitted shard of those layers.
        """
        accused = self.get(node_id)
        why = may_report_failure(self.nodes.get(sender), accused) or ticket_names(
            report.ticket, self.tickets.key.public_key(), sender, node_id, report.model, session=report.chain_id)
        if why:
            log.warning("refused an audit report of %s from %s: %s", node_id, sender, why)
            raise Forbidden(f"{sender} may not report {node_id}: {why}", code="not_on_route")
        steps, why = read_evidence(report, accused_key)
        if why:
            self._accuser_at_fault(sender, node_id, AuditVerdict(FORGED, why))
            raise InvalidRequest(f"the audit evidence against {node_id} is not its own: {why}", code="forged_evidence",
                                 status=422)
        layers, model = report.layers, canonical_model_name(report.model)
        shard = next((s for n, s in self.admitted_shards(model) if n.node_id == node_id
                      and s.layers.start <= layers.start and layers.end <= s.layers.end), None)
        if shard is None:
            raise InvalidRequest(f"{node_id} holds no admitted shard of {model} covering layers {layers}",
                                 code="no_holding", status=422)
        recipe = (shard.quantization, shard.report.recipe.compute_dtype)
        replayed = report.replay.witness if report.replay is not None else None
        witnesses = sorted((self._holder(n, s) for n, s in self.admitted_shards(model)
                            if n.node_id not in (node_id, sender) and n.node_id not in self.quarantined
                            and s.layers.start <= layers.start and layers.end <= s.layers.end
                            and (s.quantization, s.report.recipe.compute_dtype) == recipe),
                           key=lambda h: (h.node_id == replayed, h.node_id))  # the entry's witness last
        holder = self._holder(accused, shard)
        return AuditCase(sender, holder, model, layers, report.chain_id, tuple(steps), tuple(witnesses[:WITNESSES]),
                         audit_tolerance(*recipe))

    def apply_audit(self, case: AuditCase, verdict: AuditVerdict) -> None:
        """Act on an audit's verdict: quarantine the outvoted accused, or the witness the accused and
        the other witness outvoted, or the entry's witness whose signed replay they outvoted
        (:data:`REPLAY_OUTVOTED`), or count a false accusation against the sender; an
        inconclusive verdict changes nothing."""
        accused = case.accused.node_id
        if verdict.state in ("quarantine", "witness_outvoted", REPLAY_OUTVOTED):  # the sender's dispute caught a liar
            self._count_accusation(case.sender, "upheld")
        if verdict.state == "quarantine" and accused not in self.quarantined:
            start, end = case.layers.to_inclusive()
            self._quarantine(Quarantine(node_id=accused, reported_by=case.sender, model=case.model, shard_start=start,
                                        shard_end=end, witnesses=tuple(w.node_id for w in case.witnesses),
                                        distances=dict(verdict.distances), tolerance=case.limit))
            self.store.fail_open(accused, "node quarantined: outvoted by an audit")
            self.dirty = True
            log.warning("node %s quarantined: an audit of chain %s re-run by %s outvoted it (distances %s)", accused,
                        case.chain_id, ", ".join(w.node_id for w in case.witnesses), verdict.distances)
        elif verdict.state == "false_accusation":
            self._accuser_at_fault(case.sender, accused, verdict)
        elif verdict.state in ("witness_outvoted", REPLAY_OUTVOTED) and verdict.outvoted not in self.quarantined \
                and verdict.outvoted in self.nodes:
            start, end = case.layers.to_inclusive()
            why = ("outvoted as an audit witness" if verdict.state == "witness_outvoted"
                   else "its signed replay for an entry's audit outvoted")
            self._quarantine(Quarantine(node_id=verdict.outvoted, reported_by=f"tracker ({why})",
                                        model=case.model, shard_start=start, shard_end=end,
                                        witnesses=tuple(n for n in (accused, *(w.node_id for w in case.witnesses))
                                                        if n != verdict.outvoted),
                                        distances=dict(verdict.distances), tolerance=case.limit))
            self.store.fail_open(verdict.outvoted, f"node quarantined: {why}")
            self.dirty = True
            log.warning("node %s quarantined (%s): its outputs for chain %s's audit were unlike %s's and the "
                        "tracker's witnesses' (%s)", verdict.outvoted, why, case.chain_id, accused, verdict.distances)
        else:
            log.info("audit of %s on chain %s from %s: %s (%s)", accused, case.chain_id, case.sender, verdict.state,
                     verdict.reason)

    def _count_accusation(self, sender: str, kind: str) -> dict[str, int]:
        """Count one of ``sender``'s accusations as ``upheld``, ``false`` or ``forged``; its counts."""
        counts = self.accusations.setdefault(sender, {"upheld": 0, "false": 0, "forged": 0})
        counts[kind] += 1
        return counts

    def _accuser_at_fault(self, sender: str, accused: str, verdict: AuditVerdict) -> None:
        """Count a false or forged accusation against ``sender``: forged evidence quarantines it at
        once; false ones once there are :data:`FALSE_ACCUSATIONS` of them and more than its upheld
        ones (an honest entry's own witness may lie to it now and then, and then its accusation
        looks false; an entry that mostly accuses honest nodes is the one marked)."""
        counts = self._count_accusation(sender, "forged" if verdict.state == FORGED else "false")
        log.warning("%s accused %s falsely (%s: %s); its accusations: %s", sender, accused, verdict.state,
                    verdict.reason, counts)
        marked = verdict.state == FORGED or (counts["false"] >= FALSE_ACCUSATIONS and counts["false"] > counts["upheld"])
        if marked and sender in self.nodes and sender not in self.quarantined:
            self._quarantine(Quarantine(node_id=sender, reported_by=f"tracker ({verdict.state} accusation of {accused})",
                                        model="", shard_start=0, shard_end=0, witnesses=(),
                                        distances=dict(verdict.distances), tolerance=0.0))
            self.store.fail_open(sender, f"node quarantined: {verdict.state} accusation")
            log.warning("node %s quarantined: its accusations %s, the last %s", sender, counts, verdict.state)
        self.dirty = True

    def reinstate(self, node_id: str) -> bool:
        """Lift ``node_id``'s quarantine (operator action); returns whether it was quarantined. Its
        shards count again as soon as their reports do.

        Raises:
            NotFound: neither registered nor quarantined.
        """
        if node_id not in self.nodes and node_id not in self.quarantined:
            self.get(node_id)
        removed = self.store.remove_quarantine(node_id)
        was = self.quarantined.pop(node_id, None) is not None or removed
        if node_id in self.nodes:
            self.nodes[node_id].quarantine = None
        if was:
            self.dirty = True
            log.info("node %s reinstated by the operator", node_id)
        return was



    def report_failure_from(self, sender: NodeId, node_id: NodeId, reason: str, ticket: str = "") -> None:
        """A hop failure of ``node_id`` reported by node ``sender`` (whose signature the caller
        checked), with the session ``ticket`` whose route named it.

        Raises:
            NotFound: ``node_id`` is not registered.
            Forbidden (403 ``not_on_route``): the sender could not have had ``node_id`` on a route
                (see :func:`may_report_failure`), or ``ticket`` does not show it had (see
                :func:`ticket_names`); nothing is recorded.
        """
        reported = self.get(node_id)
        why = may_report_failure(self.nodes.get(sender), reported) or ticket_names(
            ticket, self.tickets.key.public_key(), sender, node_id)
        if why:
            log.warning("refused a failure report of %s from %s: %s", node_id, sender, why)
            raise Forbidden(f"{sender} may not report a failure of {node_id}: {why}", code="not_on_route")
        self.report_failure(node_id, f"{reason} (reported by {sender})")

    def report_failure(self, node_id: NodeId, reason: str) -> None:
        """Record a failure of ``node_id`` (routes avoid it a while); the tracker's own proxy calls it."""
        if node_id in self.nodes:
            self.nodes[node_id].last_failure_s = time.monotonic()
            log.warning("hop failure reported for %s: %s", node_id, reason)
            if self.store.shared:  # the other trackers route around it too (ADR-0054)
                self.write_soon(f"hop failure of {node_id}", self.store.add_hop_failure, node_id, time.time(),
                                self.origin)

    def apply_hop_failures(self, rows: list[dict]) -> None:
        """Hop failures other trackers heard (:meth:`TrackerStore.hop_failures`): routes here
        avoid those nodes for the rest of their cooldown too."""
        now, wall = time.monotonic(), time.time()
        for row in rows:
            node = self.nodes.get(row["node_id"])
            if node is not None:
                at = now - max(0.0, wall - row["at"])
                node.last_failure_s = at if node.last_failure_s is None else max(node.last_failure_s, at)
            self.hop_failures_seen = max(self.hop_failures_seen, row["id"])
