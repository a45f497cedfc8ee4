"""The tracker's state and decisions, independent of HTTP.

Thin shell around pure functions: it keeps node records and the store (sqlite or PostgreSQL), and calls
:mod:`placement` (who loads what), :mod:`routing` (which hops serve a request) and the
coverage helpers. Every mutating method is synchronous and cheap; the app runs the
periodic loop (dropout check and rebalance).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from meshnet.errors import NotFound
from meshnet.protocol.http import DEFAULT_MAX_BODY_BYTES
from meshnet.protocol.limits import DEFAULT_MAX_CLIENT_REQUESTS
from meshnet.presets import canonical_model_name, find_preset
from meshnet.tracker.admission import Challenge, ReferenceSource, Verdict
from meshnet.tracker.quarantine import Quarantine
from meshnet.tracker.registry import ModelInfo, NodeRecord
from meshnet.tracker.backends import open_store
from meshnet.tracker.store import TrackerStore
from meshnet.tracker.tickets import TicketIssuer
from meshnet.tracker.trust import TrustMixin
from meshnet.tracker.membership import MembershipMixin
from meshnet.tracker.directives import DirectivesMixin
from meshnet.tracker.routes import RoutesMixin
from meshnet.tracker.demand import DemandMixin

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
        max_client_requests: chat and completion requests one client may have in flight through
            this tracker at once (:mod:`meshnet.protocol.limits`, ADR-0060; 0: no limit).
        require_verified: coverage, routes and entry choice count only shards verified against
            another holder or trusted by the operator, not those admitted on their holder's word
            alone (ADR-0069; off: every admitted shard, ``verified`` in routes says which).
        speed_probe_interval_s: each admitted shard of a model with two or more holders has its
            decode speed timed by this tracker again after this many seconds, and its claimed
            tokens/s is checked against it (:mod:`meshnet.tracker.speed`, ADR-0068; 0: never).
        source_references: where admission challenges' references come from (ADR-0070): ``auto``,
            the model's own files where this host holds them; ``fetch``, fetched where it does not;
            ``off``, other holders only. The command line builds the :class:`ReferenceSource` from
            it (the service is given one: see :class:`TrackerService`).
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
    max_client_requests: int = DEFAULT_MAX_CLIENT_REQUESTS
    speed_probe_interval_s: float = 120.0
    require_verified: bool = False
    source_references: str = "auto"




class TrackerService(MembershipMixin, DirectivesMixin, RoutesMixin, DemandMixin, TrustMixin):
    """All tracker state, its decisions split by concern: :class:`MembershipMixin` (registry,
    heartbeats, dropouts), :class:`DirectivesMixin` (pins and directives), :class:`RoutesMixin`
    (coverage, routes, tickets, readiness), :class:`DemandMixin` and :class:`TrustMixin`
    (admission, quarantine, failure reports); this class holds the state they share.

    Not thread-safe: call it from the event loop only. The rebalance runs its plan and its store
    write on worker threads, but those touch only a frozen snapshot and the store (whose lock serialises it); every read and change of this object stays on the loop
    (:func:`meshnet.tracker.rebalance.rebalance_off_loop`, ADR-0037).

    On a shared store (PostgreSQL, ADR-0043) the node registry is a cache of the store's node
    records: a registration, or a heartbeat that changes a node's shards or directives, writes the
    node's record at once; a heartbeat that changes nothing only bumps its time, written once a
    second (:meth:`take_heartbeats`); records other trackers wrote arrive with :meth:`apply_rows`,
    demand they counted with :meth:`apply_demand` (:mod:`meshnet.tracker.sharing` runs both).
    Only the leader (:attr:`leader`) plans, and fails the directives of a node that dropped out.
    """

    @property
    def claims_lost(self) -> set[tuple]:
        """``(node id, model, layers)`` of every shard whose claimed speed this tracker's probes
        refuted (ADR-0068), read from the nodes' :attr:`NodeRecord.claims_refuted`."""
        return {(n.node_id, *key) for n in self.nodes.values() for key in n.claims_refuted}

    def __init__(self, settings: TrackerSettings = TrackerSettings(), store: TrackerStore | None = None,
                 reference: ReferenceSource | None = None) -> None:
        self.settings = settings
        #: computes admission challenges' references from the models' own files (ADR-0070); None: holders only
        self.reference = reference
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
        #: node id -> its audit accusations by outcome: upheld, false, forged (ADR-0067)
        self.accusations: dict[str, dict[str, int]] = {}
        #: (node id, model, start, end, report timestamp) -> the shard's verification (ADR-0042)
        self.verdicts: dict[tuple, Verdict] = {}
        #: weights digest known per model, exact range and recipe (:func:`admission.digest_key`)
        self.digests: dict[tuple, str] = {}
        #: challenges decided but not started yet (the app starts them: :meth:`take_challenges`)
        self.challenges: list[Challenge] = []
        #: speed probes running (ADR-0068): (node id, model, layers)
        self.speed_probing: set[tuple] = set()
        self.speed_scan_at = 0.0  # monotonic time of the next scan for due speed probes
        self.tickets = TicketIssuer(self.store.tracker_key(), settings.ticket_ttl_s)
        #: this tracker process, as demand events name it (ADR-0043)
        self.origin = uuid.uuid4().hex[:16]
        self.started_at = time.time()  #: unix seconds this tracker started (its models' ``created``)
        self._leading = not self.store.shared  # as of the last sync round (sqlite: always)
        #: monotonic time before which no node is dropped: a shared store was unreachable, so the
        #: heartbeats other trackers heard meanwhile are not known here yet (ADR-0054)
        self.blind_until = 0.0
        self.demand_seen = 0  # the highest demand event id read from the store
        self.hop_failures_seen = 0  # the highest hop failure id read from the store
        self._writing: set[asyncio.Future] = set()  # store writes nothing waits for (write_soon)
        self._heartbeats: dict[str, float] = {}  # node id -> unix time of a heartbeat not written yet
        #: the nodes with queued directives as of the start (on a shared store: the last sync round)
        #: plus those this tracker queued since: a heartbeat of any other node reads nothing
        self.queued_hint: set[str] = set(self.store.nodes_with_queued())
        self._queued_since_read: set[str] = set()
        for name in settings.models:
            self.store.add_model(canonical_model_name(name))
        #: the tracked models' names as of the last read of the store (the sync round reads them
        #: again on a shared store, so no request waits on the database for them, ADR-0054)
        self.tracked_names: set[str] = set(self.store.models())
        for name in self.tracked_names:
            self.ensure_model(name)
        self.apply_demand(self.store.demand_events(since=time.time() - settings.demand_window_s))
        self.apply_quarantines(self.store.quarantines())


    def write_soon(self, what: str, write, *args) -> None:
        """Run a store write nothing waits for (a demand event, a shared hop failure): on a worker
        thread when an event loop runs on this thread (the loop never waits on the database), else
        now. A failure is logged as ``<what> not stored``; :meth:`writes_done` waits for the pending ones."""
        def run() -> None:
            try:
                write(*args)
            except Exception as exc:  # nothing waits for it: counted here, the store misses it (ADR-0054)
                log.warning("%s not stored (database unreachable: %s)", what, exc)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            run()
            return
        future = loop.run_in_executor(None, run)
        self._writing.add(future)
        future.add_done_callback(self._writing.discard)

    async def writes_done(self) -> None:
        """Wait for the writes :meth:`write_soon` started (the sync round, before it reads; shutdown)."""
        if self._writing:
            await asyncio.gather(*list(self._writing))

    @property
    def leader(self) -> bool:
        """Plans and issues directives: always on sqlite; on a shared store while its lease, as of
        the last sync round, is still valid by this process's clock (ADR-0054)."""
        return self._leading and self.store.lease_valid()

    @leader.setter
    def leader(self, leading: bool) -> None:
        self._leading = leading
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
            raise NotFound(f"unknown model {name!r}", code="model_not_found", param="model",
                           hint="GET /v1/models lists the models served; `meshnet models list` the presets")
        self.models[info.name] = info
        return info

    def track_model(self, name: str, source: str = "operator") -> None:
        """Track ``name`` from now on (kept in the store, so it survives a restart). Demand for a
        model tracked already writes nothing; demand for a new one is written off the event loop."""
        if source == "demand":
            if name not in self.tracked_names:
                self.write_soon(f"tracking of {name}", self.store.add_model, name, "demand")
        else:
            self.store.add_model(name, source=source)
        self.tracked_names.add(name)

    def tracked_models(self) -> list[ModelInfo]:
        """The models this network keeps covered: those tracked (``--model``, pins, demand) and
        those any node serves; read from memory."""
        names = {canonical_model_name(m) for m in self.tracked_names}
        names |= {s.model for n in self.nodes.values() for s in n.shards}
        return [self.ensure_model(n) for n in sorted(names)]
