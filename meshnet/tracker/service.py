"""The tracker's state and decisions, independent of HTTP.

Thin shell around pure functions: it keeps node records and the store (sqlite or PostgreSQL), and calls
:mod:`placement` (who loads what), :mod:`routing` (which hops serve a request) and the
coverage helpers. Every mutating method is synchronous and cheap; the app runs the
periodic loop (dropout check and rebalance).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshnet.errors import Conflict, Forbidden, InvalidRequest, ModelNotRoutable, NotFound
from meshnet.protocol.http import DEFAULT_MAX_BODY_BYTES
from meshnet.layers import LayerRange
from meshnet.presets import canonical_model_name, find_preset
from meshnet.tracker import placement, readiness, routing
from meshnet.protocol.views import Coverage, CoverageSegment
from meshnet.tracker.cadence import TIMEOUT_FACTOR, Cadence, heartbeat_cadence
from meshnet.protocol.control import (OPEN_STATUSES, CapabilityReport, Directive, HeartbeatRequest,
                                      RegisterRequest)
from meshnet.tracker.admission import Challenge, Verdict
from meshnet.tracker.quarantine import Quarantine
from meshnet.tracker.registry import NodeRecord, ShardRecord, record_from_json, record_to_json
from meshnet.tracker.backends import open_store
from meshnet.tracker.store import DemandEvent, NodeRow, TrackerStore
from meshnet.tracker.tickets import TicketIssuer
from meshnet.tracker.trust import TrustMixin, may_report_failure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackerSettings:
    """Tracker settings (CLI flag > MESHNET_* env > default).

    Attributes:
        models: presets the tracker keeps covered.
        heartbeat_interval_s: the shortest interval nodes are told to use (DESIGN: 10 s); it grows
            with the network (:func:`meshnet.tracker.cadence.heartbeat_cadence`, ADR-0037).
        node_timeout_s: missing heartbeats for this long ⇒ dropout (the shortest; it grows with
            the interval announced to the node).
        rebalance_interval_s: periodic rebalance (DESIGN: 30 s; also on every join/leave).
        db_path: sqlite file (``:memory:`` for tests), or a ``postgresql://`` URL: a database
            several trackers share, one leading (ADR-0043).
        operator_token: bearer token for /v1/operator/* (None: open, for local use).
        join_token: token a node must present to register (None: anyone may join, for local
            use); a tracker listening beyond loopback needs both tokens unless ``insecure``.
        insecure: run beyond loopback without tokens, on purpose (ADR-0035).
        load_failure_cooldown_s: a node whose LOAD_SHARD failed gets no new load for this long.
        join_settle_s: after a join, wait this long for more joins before rebalancing, so nodes
            starting together are planned together (the widest range to the biggest/fastest).
        max_body_bytes: largest request body (413 above; see
            :data:`meshnet.protocol.http.DEFAULT_MAX_BODY_BYTES`).
        demand_window_s: window over which demand and load rates are counted, seconds.
        probe_timeout_s: a reachability probe of a node's endpoint must answer within this, seconds.
        probe_interval_s: an unreachable node is probed again after this many seconds.
        drain_grace_s: on SIGTERM, seconds proxied chats may take to finish (ADR-0032).
        ticket_ttl_s: how long a session ticket is valid, seconds (ADR-0038); the tracker's key
            that signs them lives next to ``db_path``.
        directive_retention_s: finished (done/failed) directives are deleted this long after
            their last update, seconds (ADR-0037; default one day).
        admission_challenges: challenge each new shard against an admitted holder of its layers
            before it is routed (ADR-0042); off, every passed shard is admitted unverified
            (after the weights-digest check).
        challenge_timeout_s: how long one challenge call may take, seconds.
    """

    host: str = "127.0.0.1"
    port: int = 8700
    models: tuple[str, ...] = ()
    heartbeat_interval_s: float = 10.0
    node_timeout_s: float = 25.0
    rebalance_interval_s: float = 30.0
    db_path: str = ":memory:"
    operator_token: str | None = None
    join_token: str | None = None
    insecure: bool = False
    load_failure_cooldown_s: float = 60.0
    join_settle_s: float = 2.0
    demand_window_s: float = 300.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    probe_timeout_s: float = 3.0
    probe_interval_s: float = 1.0
    drain_grace_s: float = 30.0
    ticket_ttl_s: float = 600.0
    directive_retention_s: float = 86_400.0
    admission_challenges: bool = True
    challenge_timeout_s: float = 30.0


def may_enter(sender: NodeRecord | None, model: str) -> str:
    """Why ``sender`` may not get a session ticket for ``model`` ("" when it may): only a
    registered node holding an entry shard of the model drives its sessions."""
    if sender is None:
        return "the sender is not a registered node"
    if not any(s.entry and s.model == model for s in sender.shards):
        return f"the sender holds no entry shard of {model}"
    return ""


@dataclass
class ModelInfo:
    name: str
    num_layers: int
    bytes_per_layer: dict[str, int] = field(default_factory=dict)
    hf_repo: str = ""


class TrackerService(TrustMixin):
    """All tracker state. Not thread-safe: call it from the event loop only. The rebalance runs its
    plan and its store write on worker threads, but those touch only a frozen snapshot and the
    store (whose lock serialises it); every read and change of this object stays on the loop
    (:func:`meshnet.tracker.rebalance.rebalance_off_loop`, ADR-0037).

    On a shared store (PostgreSQL, ADR-0043) the node registry is a cache of the store's node
    records: a registration, or a heartbeat that changes a node's shards or directives, writes the
    node's record at once; a heartbeat that changes nothing only bumps its time, written once a
    second (:meth:`take_heartbeats`); records other trackers wrote arrive with :meth:`apply_rows`,
    demand they counted with :meth:`apply_demand` (:mod:`meshnet.tracker.sharing` runs both).
    Only the leader (:attr:`leader`) plans, and fails the directives of a node that dropped out.
    """

    def __init__(self, settings: TrackerSettings = TrackerSettings(), store: TrackerStore | None = None) -> None:
        self.settings = settings
        self.store = store or open_store(settings.db_path)
        self.nodes: dict[str, NodeRecord] = {}
        self._bound_keys: dict[str, str] = {}  # node id -> public key, as read from the store
        self.models: dict[str, ModelInfo] = {}
        self.demand: dict[str, list[float]] = {}   # requests refused while not routable
        self.served: dict[str, list[float]] = {}   # requests forwarded to an entry node
        self.dirty = True  # a join/leave happened: rebalance soon
        self.last_join_s = 0.0
        self.plan_reasons: Mapping[str, str] = {}  # node id -> why it did or did not get a range
        #: node id -> why it is quarantined (ADR-0042); kept across its re-registrations
        self.quarantined: dict[str, Quarantine] = {}
        #: (node id, model, start, end, report timestamp) -> the shard's verification (ADR-0042)
        self.verdicts: dict[tuple, Verdict] = {}
        #: weights digest known per model, exact range and recipe (:func:`admission.digest_key`)
        self.digests: dict[tuple, str] = {}
        #: challenges decided but not started yet (the app starts them: :meth:`take_challenges`)
        self.challenges: list[Challenge] = []
        self.tickets = TicketIssuer(self.store.tracker_key(), settings.ticket_ttl_s)
        #: this tracker process, as demand events name it (ADR-0043)
        self.origin = uuid.uuid4().hex[:16]
        #: plans and issues directives: always on sqlite; on a shared store while holding the lock
        self.leader = not self.store.shared
        self.demand_seen = 0  # the highest demand event id read from the store
        self._heartbeats: dict[str, float] = {}  # node id -> unix time of a heartbeat not written yet
        #: on a shared store, the nodes with queued directives as of the last sync round plus those
        #: this tracker queued since: a heartbeat of any other node reads nothing (None: always read)
        self.queued_hint: set[str] | None = set(self.store.nodes_with_queued()) if self.store.shared else None
        self._queued_since_read: set[str] = set()
        for name in settings.models:
            self.store.add_model(canonical_model_name(name))
        for name in self.store.models():
            self.ensure_model(name)
        self.apply_demand(self.store.demand_events(since=time.time() - settings.demand_window_s))
        self.apply_quarantines(self.store.quarantines())

    # ---- models -----------------------------------------------------------------------

    def ensure_model(self, name: str, num_layers: int | None = None) -> ModelInfo:
        """Known model info, from its preset or a node's report.

        Raises:
            NotFound: not a preset and no layer count known.
        """
        name = canonical_model_name(name)
        if name in self.models:
            return self.models[name]
        preset = find_preset(name)
        if preset is not None:
            info = ModelInfo(preset.name, preset.num_layers, dict(preset.bytes_per_layer), preset.hf_repo)
        elif num_layers:
            info = ModelInfo(name, num_layers, {"bfloat16": 1})
        else:
            raise NotFound(f"unknown model {name!r}", code="model_not_found",
                           hint="use a preset name (`meshnet models list`)")
        self.models[info.name] = info
        return info

    def tracked_models(self) -> list[ModelInfo]:
        names = {canonical_model_name(m) for m in self.store.models()}
        names |= {s.model for n in self.nodes.values() for s in n.shards}
        return [self.ensure_model(n) for n in sorted(names)]

    # ---- nodes ------------------------------------------------------------------------

    def register(self, payload: RegisterRequest) -> NodeRecord:
        """Record a node's registration (a restart re-registers: its record is replaced).

        The node id is bound to ``payload.public_key`` at its first registration, in the store
        (ADR-0035); the caller has checked that the sender holds that key.

        Raises:
            Conflict (409 ``node_id_taken``): the id is bound to another key; the record is unchanged.
            NotFound: a shard of an unknown model without a layer count.
        """
        node_id = payload.node_id
        bound = self.store.bind_key(node_id, payload.public_key)
        self._bound_keys[node_id] = bound  # its heartbeats' signatures are checked against it
        if bound != payload.public_key:
            log.warning("refused a registration of %s with another key (endpoint %s)", node_id, payload.endpoint)
            raise Conflict(f"node id {node_id!r} belongs to another key; this registration is refused",
                           code="node_id_taken",
                           hint="a node keeps its key in its --state-dir (node.key): start it with the same "
                                "state dir, or choose another --node-id")
        for s in payload.shards:
            self.ensure_model(s.model, s.num_layers)
        record = NodeRecord(node_id=node_id, endpoint=payload.endpoint.rstrip("/"), wallet=payload.wallet,
                            vram_bytes=payload.vram_bytes, ram_bytes=payload.ram_bytes, device=payload.device,
                            quantizations=list(payload.quantizations),
                            benchmark_tokens_per_sec=payload.benchmark_tokens_per_sec,
                            benchmark_model=payload.benchmark_model, max_loaded_shards=payload.max_loaded_shards,
                            accepts_placement=payload.accepts_placement,
                            shards=[ShardRecord.from_payload(s) for s in payload.shards],
                            relay_url=payload.relay_url, relay_rtt_s=payload.relay_rtt_s)
        old = self.nodes.get(node_id)
        if old is not None:
            record.stale_reports, record.draining = old.stale_reports, old.draining
            if old.endpoint == record.endpoint:
                record.reachable, record.reach_error, record.probed_s = old.reachable, old.reach_error, old.probed_s
        record.quarantine = self.quarantined.get(node_id)
        self.nodes[node_id] = record
        self.verify_shards(record)
        self.dirty = True
        if old is None:
            self.last_join_s = time.monotonic()
        self.save(record)
        log.info("node %s registered at %s with %d shard(s)", node_id, record.endpoint, len(record.shards))
        self.restore_pins(record)
        return record

    # ---- operator decisions (the HTTP handlers only validate and call these) ---------------

    def queue_directive(self, node_id: str, type_: str, *, model: str | None = None,
                        layers: LayerRange | None = None, tier: str | None = None, reason: str = "") -> Directive:
        """Queue one directive for ``node_id`` (delivered with its next heartbeat); returns its row."""
        start, end = layers.to_inclusive() if layers is not None else (None, None)
        directive = self.store.add_directive(node_id, type_, model=model, shard_start=start, shard_end=end, tier=tier,
                                             reason=reason)
        self.note_queued([node_id])
        return directive

    def restore_pins(self, node: NodeRecord) -> list[Directive]:
        """Give a (re)registering node back every shard the operator pinned on it.

        A pin is operator intent kept in the store: a node that comes back without its pinned
        shard (a restart with no shard flags, or after a tracker restart) gets a ``LOAD_SHARD``
        with tier ``pinned``, unless it already holds that range or such a load is still open.
        Returns the directives queued.
        """
        held = {(s.model, s.layers) for s in node.shards}
        open_loads = {(d.model, d.shard_start, d.shard_end)
                      for d in self.store.directives(node_id=node.node_id, statuses=OPEN_STATUSES)
                      if d.type == "LOAD_SHARD"}
        queued = []
        for pin in self.store.pins(node.node_id):
            layers = LayerRange.from_inclusive(pin["shard_start"], pin["shard_end"])
            if (pin["model"], layers) in held or (pin["model"], pin["shard_start"], pin["shard_end"]) in open_loads:
                continue
            self.ensure_model(pin["model"])
            queued.append(self.queue_directive(node.node_id, "LOAD_SHARD", model=pin["model"], layers=layers,
                                               tier="pinned", reason="operator pin (restored)"))
            log.info("restoring pin %s %s on %s", pin["model"], layers, node.node_id)
        return queued

    def pin(self, node_id: str, model: str, layers: LayerRange | None = None) -> tuple[dict, list[Directive]]:
        """Pin ``model`` (``layers``, or the range placement would give the node) on ``node_id``.

        The pin is stored (it survives node and tracker restarts, see :meth:`restore_pins`); the
        node gets a ``LOAD_SHARD`` with tier ``pinned``, preceded by a ``DROP_SHARD`` of a
        non-pinned shard when all its slots are full (managed shards go first).

        Returns:
            ``(pin {node_id, model, shard_start, shard_end}, directives queued)``.

        Raises:
            NotFound: unknown node or model. InvalidRequest (422): ``layers`` beyond the model.
        """
        node = self.get(node_id)
        info = self.ensure_model(model)
        if layers is None:
            layers, _ = self.suggest_range(info, node.vram_bytes, node.quantization)
        elif layers.end > info.num_layers:
            start, end = layers.to_inclusive()
            raise InvalidRequest(f"shard {start}-{end} beyond {info.name}'s {info.num_layers} layers",
                                 code="invalid_field", status=422)
        start, end = layers.to_inclusive()
        self.store.add_model(info.name)
        self.store.add_pin(node.node_id, info.name, start, end)
        queued = []
        free = node.max_loaded_shards - len(node.shards)
        for shard in sorted(node.shards, key=lambda s: s.tier != "managed"):
            if free >= 1:
                break
            if shard.tier != "pinned":
                queued.append(self.queue_directive(node.node_id, "DROP_SHARD", model=shard.model, layers=shard.layers,
                                                   tier=shard.tier, reason="operator pin"))
                free += 1
        queued.append(self.queue_directive(node.node_id, "LOAD_SHARD", model=info.name, layers=layers, tier="pinned",
                                           reason="operator pin"))
        return {"node_id": node.node_id, "model": info.name, "shard_start": start, "shard_end": end}, queued

    def suggest_range(self, info: ModelInfo, vram_bytes: int, quantization: str) -> tuple[LayerRange, bool]:
        """The range a node of ``vram_bytes`` (recipe ``quantization``) should take of ``info``'s model
        now: the first coverage gap it fits, else redundancy (ADR-0011). Returns ``(layers, gap_found)``."""
        spec = placement.ModelSpec(info.name, info.num_layers, info.bytes_per_layer)
        counts = placement.coverage_counts(info.num_layers, [s.layers for _, s in self.admitted_shards(info.name)])
        return placement.find_assignment(spec, counts, vram_bytes, quantization)

    def unpin(self, node_id: str, model: str) -> bool:
        """Forget the operator's pin of ``model`` on ``node_id``: it is no longer restored when the
        node re-registers. The shard the node holds now keeps serving until it is dropped or the
        node restarts. Returns True when a pin was removed.

        Raises:
            NotFound: unknown model.
        """
        return self.store.remove_pin(node_id, self.ensure_model(model).name)

    def reload(self, node_id: str) -> Directive:
        """Queue a ``RELOAD``; the node's current reports stop counting until a new doctor passes."""
        node = self.get(node_id)
        node.mark_reports_stale()
        self.dirty = True
        self.save(node)
        return self.queue_directive(node.node_id, "RELOAD", reason="operator reload")

    def record_doctor(self, node_id: str, reports: list[CapabilityReport]) -> list[str]:
        """Store the capability reports a doctor run on ``node_id`` returned (matched to its shards
        by model and range); returns the reasons of those that failed."""
        node = self.get(node_id)
        by_range = {(r.model, r.layers): r for r in reports}
        for shard in node.shards:
            shard.report = by_range.get((shard.model, shard.layers), shard.report)
        self.verify_shards(node)
        self.dirty = True
        self.save(node)
        return [r.reason for r in reports if not r.passed]

    def drain(self, node_id: str) -> NodeRecord:
        """Take ``node_id`` out of routes and placement (it keeps its shards and its record)."""
        node = self.get(node_id)
        node.draining = True
        self.dirty = True
        self.save(node)
        return node

    def get(self, node_id: str) -> NodeRecord:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise NotFound(f"unknown node {node_id!r}", code="unknown_node",
                           hint="see `meshnet nodes` for node ids (a node itself re-registers on this error)") from None

    def cadence(self) -> Cadence:
        """The heartbeat interval to announce now and the matching dropout timeout (ADR-0037)."""
        return heartbeat_cadence(len(self.nodes), self.settings.heartbeat_interval_s, self.settings.node_timeout_s)

    def announce_interval(self, node: NodeRecord) -> float:
        """The heartbeat interval to tell ``node`` now, seconds; remembered so that its dropout
        timeout follows what it was told (a shrinking network never drops a node that still
        heartbeats at the longer interval it was given)."""
        node.interval_s = self.cadence().interval_s
        return node.interval_s

    def node_timeout_s(self, node: NodeRecord, cadence_timeout_s: float | None = None) -> float:
        """Seconds without a heartbeat after which ``node`` is gone: the current cadence's timeout
        (``cadence_timeout_s`` when the caller has it), or longer when the node was told a longer
        interval."""
        floor_s = self.cadence().timeout_s if cadence_timeout_s is None else cadence_timeout_s
        return max(floor_s, node.interval_s * TIMEOUT_FACTOR)

    def heartbeat(self, node_id: str, payload: HeartbeatRequest) -> list[Directive]:
        """Record a heartbeat; returns the directives to deliver (queued → delivered). The node's
        directive updates (only of its own directives) are written in one transaction, the
        deliveries in another."""
        node = self.get(node_id)
        node.last_heartbeat_s = time.monotonic()
        node.stats = payload.stats
        before = {(s.model, s.layers) for s in node.shards if node.admitted(s)}
        shards_before = node.shards
        node.shards = [ShardRecord.from_payload(s) for s in payload.shards]
        for s in payload.shards:
            self.ensure_model(s.model, s.num_layers)
        self.verify_shards(node)
        if before != {(s.model, s.layers) for s in node.shards if node.admitted(s)}:
            self.dirty = True
        if any(u.status in ("done", "failed") for u in payload.directive_updates):
            self.dirty = True
        row = self._heartbeat_row(node, bool(payload.directive_updates) or node.shards != shards_before)
        self.store.set_statuses([(u.id, u.status, u.error) for u in payload.directive_updates], node_id=node_id,
                                node=row)
        if self.queued_hint is not None and node_id not in self.queued_hint:
            return []  # nothing queued for it as of this round's read (a shared store: no query)
        out = [d.model_copy(update={"status": "delivered"})
               for d in reversed(self.store.directives(node_id=node_id, statuses=("queued",)))]
        self.store.set_statuses([(d.id, "delivered", None) for d in out], node_id=node_id)
        if self.queued_hint is not None:
            self.queued_hint.discard(node_id)
        return out

    def _heartbeat_row(self, node: NodeRecord, changed: bool) -> NodeRow | None:
        """On a shared store, the record a heartbeat that ``changed`` the node's shards or directives
        writes in the same transaction as its directive updates (no tracker ever sees a finished
        load without its shard); for one that changed nothing only its time is noted, for the
        round's batch. None on sqlite, or when nothing changed."""
        if not self.store.shared:
            return None
        if not changed:
            self._heartbeats[node.node_id] = time.time()
            return None
        node.record_at = time.time()
        self._heartbeats.pop(node.node_id, None)
        return self.node_row(node)

    def note_queued(self, node_ids) -> None:
        """Directives were queued for ``node_ids`` by this tracker: their next heartbeat reads them."""
        if self.queued_hint is not None:
            node_ids = set(node_ids)
            self.queued_hint |= node_ids
            self._queued_since_read |= node_ids

    def take_queued_since_read(self) -> set[str]:
        """The nodes this tracker queued directives for since the last call (the sync round's read)."""
        out, self._queued_since_read = self._queued_since_read, set()
        return out

    def set_reachability(self, node_id: str, endpoint: str, error: str, now: float | None = None) -> None:
        """Record a probe of ``node_id`` at ``endpoint``: ``error`` is ``""`` when it answered, else why not.
        A change in reachability changes admission, so it triggers a rebalance. A probe of an
        endpoint the node no longer advertises (it re-registered meanwhile) is ignored."""
        node = self.nodes.get(node_id)
        if node is None or node.endpoint != endpoint:
            return
        node.probed_s = time.monotonic() if now is None else now
        reachable = not error
        if reachable != node.reachable:
            self.dirty = True
        if reachable and not node.reachable:
            log.info("node %s is reachable at %s", node_id, node.endpoint)
        elif node.reachable and not reachable:
            log.warning("node %s became unreachable: %s", node_id, error)
        elif not reachable and error != node.reach_error:  # a node registers before it listens: often once
            log.info("node %s not reachable (yet): %s", node_id, error)
        changed = (reachable, error) != (node.reachable, node.reach_error)
        node.reachable, node.reach_error = reachable, error
        self.verify_shards(node)
        if changed:
            self.save(node)

    def to_probe(self, now: float | None = None) -> list[NodeRecord]:
        """Unreachable nodes whose last probe is ``probe_interval_s`` old or more."""
        now = time.monotonic() if now is None else now
        return [n for n in self.nodes.values() if not n.reachable
                and (n.probed_s is None or now - n.probed_s >= self.settings.probe_interval_s)]

    def public_key(self, node_id: str) -> str | None:
        """The public key bound to ``node_id`` (base64url), or None when the id was never registered.

        A binding never changes once made (another key is refused 409), so each is read from the
        store once and then served from memory: every heartbeat asks for it.
        """
        key = self._bound_keys.get(node_id)
        if key is None:
            key = self.store.node_key(node_id)
            if key is not None:
                self._bound_keys[node_id] = key
        return key

    def report_failure_from(self, sender: str, node_id: str, reason: str) -> None:
        """A hop failure of ``node_id`` reported by node ``sender`` (whose signature the caller checked).

        Raises:
            NotFound: ``node_id`` is not registered.
            Forbidden (403 ``not_on_route``): the sender could not have had ``node_id`` on a route
                (see :func:`may_report_failure`); nothing is recorded.
        """
        reported = self.get(node_id)
        why = may_report_failure(self.nodes.get(sender), reported)
        if why:
            log.warning("refused a failure report of %s from %s: %s", node_id, sender, why)
            raise Forbidden(f"{sender} may not report a failure of {node_id}: {why}", code="not_on_route")
        self.report_failure(node_id, f"{reason} (reported by {sender})")

    def report_failure(self, node_id: str, reason: str) -> None:
        """Record a failure of ``node_id`` (routes avoid it a while); the tracker's own proxy calls it."""
        if node_id in self.nodes:
            self.nodes[node_id].last_failure_s = time.monotonic()
            log.warning("hop failure reported for %s: %s", node_id, reason)

    def check_dropouts(self, now: float | None = None) -> list[str]:
        """Drop nodes whose last heartbeat is older than their timeout (:meth:`node_timeout_s`);
        returns their ids."""
        now = time.monotonic() if now is None else now
        floor_s = self.cadence().timeout_s  # once per check, not once per node
        gone = [(nid, now - n.last_heartbeat_s) for nid, n in self.nodes.items()
                if now - n.last_heartbeat_s > self.node_timeout_s(n, floor_s)]
        if gone and self.store.shared:  # it may heartbeat to another tracker of this database
            elsewhere = self.store.heartbeat_times([nid for nid, _ in gone])
            wall = time.time()
            for nid, at in elsewhere.items():
                self.nodes[nid].last_heartbeat_s = max(self.nodes[nid].last_heartbeat_s, now - (wall - at))
            gone = [(nid, now - self.nodes[nid].last_heartbeat_s) for nid, _ in gone
                    if now - self.nodes[nid].last_heartbeat_s > self.node_timeout_s(self.nodes[nid], floor_s)]
        for nid, silent_s in gone:
            self._forget(nid, "node dropped out")
            log.warning("node %s dropped out (no heartbeat for %.0f s)", nid, silent_s)
        return [nid for nid, _ in gone]

    def deregister(self, node_id: str) -> None:
        """Forget a node that leaves on purpose (end of its drain); its open directives fail.

        Raises:
            NotFound: unknown node.
        """
        self.get(node_id)
        self._forget(node_id, "node deregistered", final=True)
        log.info("node %s deregistered", node_id)

    def _forget(self, node_id: str, why: str, *, final: bool = False) -> None:
        """Forget ``node_id``. Its open directives fail and its shared record goes when this tracker
        leads or the node left on purpose (``final``); a standby that stopped hearing from a node
        only forgets it, since the leader decides dropouts (ADR-0043)."""
        del self.nodes[node_id]
        self._heartbeats.pop(node_id, None)
        self.verdicts = {k: v for k, v in self.verdicts.items() if k[0] != node_id}
        if self.leader or final:
            self.store.fail_open(node_id, why)
            if self.store.shared:
                self.store.delete_node(node_id)
        self.dirty = True

    # ---- sharing one database with other trackers (ADR-0043) ---------------------------

    def node_row(self, node: NodeRecord) -> NodeRow:
        """``node``'s shared record, heard of now."""
        return NodeRow(node.node_id, record_to_json(node), node.record_at, time.time())

    def save(self, node: NodeRecord) -> None:
        """Write ``node``'s record for the other trackers of a shared store (nothing on sqlite)."""
        if self.store.shared:
            node.record_at = time.time()
            self._heartbeats.pop(node.node_id, None)
            self.store.save_node(self.node_row(node))

    def take_heartbeats(self) -> dict[str, float]:
        """Node id → unix time of the heartbeats not written yet (:meth:`TrackerStore.touch_nodes`); cleared."""
        out, self._heartbeats = self._heartbeats, {}
        return out

    def apply_rows(self, rows: list[NodeRow], now: float | None = None) -> int:
        """Take the records other trackers wrote (:meth:`TrackerStore.nodes_changed`) where they are
        newer than this tracker's; returns how many changed the registry. A record that cannot be
        read (another meshnet version) is skipped with a warning."""
        now = time.monotonic() if now is None else now
        wall, changed = time.time(), 0
        for row in rows:
            old = self.nodes.get(row.node_id)
            if old is not None and old.record_at >= row.record_at:
                continue
            try:
                record = record_from_json(row.record, now - max(0.0, wall - row.heartbeat_at))
                for shard in record.shards:
                    self.ensure_model(shard.model)
            except (ValueError, KeyError, TypeError, NotFound) as exc:
                log.warning("skipped the shared record of %s: %s", row.node_id, exc)
                continue
            if old is None:
                self.last_join_s = time.monotonic()
            else:
                record.last_failure_s, record.last_move_s = old.last_failure_s, old.last_move_s
                record.last_heartbeat_s = max(record.last_heartbeat_s, old.last_heartbeat_s)
            record.quarantine = self.quarantined.get(row.node_id)  # from the store's quarantines table (ADR-0042)
            self.nodes[row.node_id] = record
            self.verify_shards(record)  # the verdicts this tracker holds for its reports (ADR-0042)
            changed += 1
        if changed:
            self.dirty = True
        return changed

    def apply_demand(self, events: list[DemandEvent], now: float | None = None) -> None:
        """Count demand events other trackers stored (or this one, before a restart)."""
        now = time.monotonic() if now is None else now
        wall = time.time()
        for e in events:
            target = self.demand if e.kind == "refused" else self.served
            target.setdefault(e.model, []).append(now - max(0.0, wall - e.at))
            self.demand_seen = max(self.demand_seen, e.id)
        if any(e.kind == "refused" for e in events):
            self.dirty = True

    def _count(self, model: str, kind: str, now: float | None) -> None:
        target = self.demand if kind == "refused" else self.served
        target.setdefault(model, []).append(time.monotonic() if now is None else now)
        self.store.add_demand_event(DemandEvent(model, kind, time.time(), self.origin))

    # ---- coverage and routes ----------------------------------------------------------

    def admitted_shards(self, model: str) -> list[tuple[NodeRecord, ShardRecord]]:
        """Admitted shards of ``model`` (any of its names)."""
        model = canonical_model_name(model)
        return [(n, s) for n in self.nodes.values() for s in n.shards if s.model == model and n.admitted(s)]

    def coverage(self, model: str) -> Coverage:
        """``model``'s coverage map over its admitted shards (segments inclusive, ADR-0002).

        Raises:
            NotFound: unknown model.
        """
        info = self.ensure_model(model)
        admitted = [s for _, s in self.admitted_shards(model)]
        counts = placement.coverage_counts(info.num_layers, [s.layers for s in admitted])
        segments, start = [], 0
        for layer in range(1, info.num_layers + 1):
            if layer == info.num_layers or counts[layer] != counts[start]:
                segments.append(CoverageSegment(start_layer=start, end_layer=layer - 1, node_count=counts[start]))
                start = layer
        covered = sum(1 for c in counts if c > 0)
        has_entry = any(s.entry for s in admitted)
        return Coverage(model=info.name, num_layers=info.num_layers, segments=segments, covered_layers=covered,
                        routable=covered == info.num_layers and has_entry, demand=self.demand_rate(info.name))

    def candidates(self, model: str, end_layer: int) -> list[routing.ShardCandidate]:
        """Admitted shards of ``model`` starting before ``end_layer`` (full shard ranges: the
        measured tokens/s is over the whole shard; choose_route trims past ``num_layers``).

        Load is the node's live KV-cache sessions. Per-hop network latency is not measured yet
        (nodes report compute time only, which tokens/s already counts), so it is 0 here, except
        the relay's extra leg for a relayed node (:func:`routing.relay_latency_s`, ADR-0045).
        """
        now = time.monotonic()
        out = []
        for node, shard in self.admitted_shards(model):
            if shard.layers.start >= end_layer:
                continue
            age = None if node.last_failure_s is None else now - node.last_failure_s
            out.append(routing.ShardCandidate(node.node_id, node.endpoint, shard.layers, node.tokens_per_s(shard),
                                              routing.relay_latency_s(node.relay_url,
                                                                      node.stats.relay_rtt_s or node.relay_rtt_s),
                                              node.stats.sessions, age))
        return out

    def recipe_of(self, node_id: str, model: str, layers: LayerRange) -> tuple[str, str] | None:
        """``(quantization, compute dtype)`` of ``node_id``'s admitted shard of ``model`` covering
        ``layers`` (None: it holds none)."""
        for n, s in self.admitted_shards(model):
            if n.node_id == node_id and s.layers.start <= layers.start and layers.end <= s.layers.end:
                return s.quantization, s.report.recipe.compute_dtype
        return None

    def route(self, model: str, layers: LayerRange, exclude: frozenset[str] = frozenset(),
              like: str | None = None) -> list[routing.Hop]:
        """Hops covering exactly ``layers`` of ``model``; with ``like``, only through shards of the same
        recipe (quantization and compute dtype) as that node's over ``layers`` (ADR-0042: spot-check
        witnesses compute what the checked hop computes, so one tolerance fits).

        Raises:
            NoRoute (503 model_loading): some layer has no usable admitted shard.
        """
        info = self.ensure_model(model)
        if layers.end > info.num_layers:
            raise InvalidRequest(f"layers {layers} beyond {model}'s {info.num_layers} layers",
                                 code="invalid_field", status=422)
        try:
            candidates = self.candidates(model, layers.end)
            if like is not None:
                recipe = self.recipe_of(like, model, layers)
                same = {(n.node_id, s.layers) for n, s in self.admitted_shards(model)
                        if recipe is not None and (s.quantization, s.report.recipe.compute_dtype) == recipe}
                candidates = [c for c in candidates if (c.node_id, c.layers) in same]
            return routing.choose_route(layers.end, candidates, start_layer=layers.start, exclude=exclude)
        except routing.NoRoute as exc:
            full = routing.NoRoute(exc.gap_start, info.num_layers)
            full.coverage = self.coverage(model).model_dump()
            raise full from None

    def unverified_hops(self, model: str, hops: list[routing.Hop]) -> list[str]:
        """Node ids of ``hops`` whose layers no other admitted holder covers (nothing can
        spot-check them, ADR-0042)."""
        shards = self.admitted_shards(model)
        return [h.node_id for h in hops
                if not any(n.node_id != h.node_id and s.layers.start <= h.layers.start and h.layers.end <= s.layers.end
                           for n, s in shards)]

    def session_ticket(self, entry: str, session: str, model: str, hops: list[routing.Hop]) -> str:
        """A ticket for ``hops`` of ``model`` in ``session``, driven by node ``entry`` (whose signature
        the caller checked).

        Raises:
            Forbidden (403 ``not_an_entry``): ``entry`` holds no entry shard of ``model``;
                (403 ``session_taken``): another entry owns ``session``.
        """
        info = self.ensure_model(model)
        why = may_enter(self.nodes.get(entry), info.name)
        if why:
            raise Forbidden(f"{entry} may not drive sessions of {info.name}: {why}", code="not_an_entry")
        return self.tickets.issue(session=session, model=info.name, entry=entry, entry_key=self.public_key(entry) or "",
                                  hops=hops)

    def entry_nodes(self, model: str) -> list[NodeRecord]:
        """Admitted entry nodes of a routable model (so never a draining one), in the order a chat
        tries them: ones without a recent failure (hop or proxy) first, then least loaded. At
        least one.

        Raises:
            ModelNotRoutable: coverage gap or no entry node; the request counts as demand.
        """
        info = self.ensure_model(model)
        cov = self.coverage(info.name)
        entries = [(n, s) for n, s in self.admitted_shards(info.name) if s.entry]
        if not cov.routable:  # routable implies an admitted entry node
            self.add_demand(info.name)
            raise ModelNotRoutable(f"model {info.name} is not routable yet: {cov.covered_layers}/{info.num_layers} "
                                   "layers covered by admitted nodes", coverage=cov.model_dump(), retry_after_s=5,
                                   hint="retry after Retry-After seconds; the tracker places shards where demand appears")
        now = time.monotonic()

        def failed_recently(n: NodeRecord) -> bool:
            return n.last_failure_s is not None and now - n.last_failure_s < routing.FAILURE_COOLDOWN_S

        ranked = sorted(entries, key=lambda e: (failed_recently(e[0]), e[0].stats.requests_running,
                                                e[0].stats.sessions, e[0].node_id))
        return list({n.node_id: n for n, _ in ranked}.values())

    def readiness(self, model: str | None = None, *, draining: bool = False) -> dict:
        """Whether a chat can be served now (of ``model``, or of any tracked model), and why not.

        Raises:
            NotFound: ``model`` is not known.
        """
        names = [self.ensure_model(model).name] if model else [m.name for m in self.tracked_models()]
        return readiness.tracker_readiness([self.coverage(n).model_dump() for n in names], draining=draining)

    # ---- demand -----------------------------------------------------------------------

    def add_demand(self, model: str, now: float | None = None) -> None:
        """Count a request refused because ``model`` was not routable (queued demand); stored, so it
        survives a restart and reaches the other trackers of a shared store."""
        self._count(model, "refused", now)
        self.store.add_model(model, source="demand")
        self.dirty = True

    def add_served(self, model: str, now: float | None = None) -> None:
        """Count a request forwarded to an entry node (the load that earns redundancy); stored."""
        self._count(model, "served", now)

    def _rate(self, events: dict[str, list[float]], model: str, now: float | None) -> float:
        now = time.monotonic() if now is None else now
        window = self.settings.demand_window_s
        kept = [t for t in events.get(model, []) if now - t <= window]
        events[model] = kept
        return len(kept) * 60.0 / window

    def demand_rate(self, model: str, now: float | None = None) -> float:
        """Queued demand for ``model``: refused requests per minute over the demand window."""
        return self._rate(self.demand, model, now)

    def load_rate(self, model: str, now: float | None = None) -> float:
        """All requests per minute for ``model`` (served plus refused) over the demand window."""
        return self._rate(self.served, model, now) + self.demand_rate(model, now)
