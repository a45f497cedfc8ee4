"""The tracker's node registry over time (part of :class:`meshnet.tracker.service.TrackerService`).

A node registers (its id bound to its key, ADR-0035), heartbeats at the cadence it is told
(ADR-0037), is probed until reachable, and is forgotten when it leaves or drops out. On a shared
store (ADR-0043) the registry is a cache of the store's node records: :meth:`MembershipMixin.save`
writes one, :meth:`MembershipMixin.apply_rows` takes the ones other trackers wrote.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from meshnet.protocol.ids import NodeId
from meshnet.errors import Conflict, NotFound
from meshnet.tracker.cadence import MAX_DROPOUT_S, TIMEOUT_FACTOR, Cadence, heartbeat_cadence
from meshnet.protocol.control import Directive, HeartbeatRequest, RegisterRequest
from meshnet.tracker.registry import NodeRecord, ShardRecord, record_from_json, record_to_json
from meshnet.tracker.store import NodeRow, StaleCall

log = logging.getLogger(__name__)

#: dropouts one check logs a line each; past it, one line for the rest
LOGGED_DROPOUTS = 20


def _log_dropouts(gone: list[tuple[str, float]]) -> None:
    """A warning per dropped node up to :data:`LOGGED_DROPOUTS`, one line for the rest (a line each
    would hold the event loop: 30 us a line)."""
    for nid, silent_s in gone[:LOGGED_DROPOUTS]:
        log.warning("node %s dropped out (no heartbeat for %.0f s)", nid, silent_s)
    if len(gone) > LOGGED_DROPOUTS:
        log.warning("%d more nodes dropped out at once (no heartbeat for %.0f-%.0f s)", len(gone) - LOGGED_DROPOUTS,
                    min(s for _, s in gone[LOGGED_DROPOUTS:]), max(s for _, s in gone[LOGGED_DROPOUTS:]))


@dataclass
class HeartbeatWrite:
    """What a heartbeat leaves for the store (:meth:`MembershipMixin.heartbeat_store`): directive
    updates ``(id, status, error)``, the node's record on a shared store (None: nothing to write),
    whether its queued directives are to be read, and the node's shards and record time before it
    (restored when the write fails)."""

    node_id: str
    updates: list[tuple[int, str, str | None]]
    shards_before: list = field(default_factory=list)
    record_at: float = 0.0
    row: NodeRow | None = None
    deliver: bool = True

    @property
    def needs_store(self) -> bool:
        """Whether :meth:`MembershipMixin.heartbeat_store` has anything to do."""
        return bool(self.updates) or self.row is not None or self.deliver


class MembershipMixin:
    """Registration, heartbeats, reachability and dropouts of :class:`TrackerService`'s nodes
    (which provides ``nodes``, ``store``, ``settings``, ``dirty``, ``ensure_model``,
    ``verify_shards``, ``restore_pins`` and ``write_soon``)."""

    def register(self, payload: RegisterRequest, sent_at: float = 0.0) -> NodeRecord:
        """Record a node's registration (a restart re-registers: its record is replaced), all on the
        calling thread (tests, tools; the tracker's app runs the store's part on a worker thread:
        :meth:`bind`, :meth:`begin_register`, :meth:`register_store`, :meth:`end_register`).

        The node id is bound to ``payload.public_key`` at its first registration, in the store
        (ADR-0035); the caller has checked that the sender holds that key. ``sent_at``: the
        call's signed time (unix seconds, the node's clock; 0: unordered).

        Raises:
            Conflict (409 ``node_id_taken``): the id is bound to another key; the record is unchanged.
            Conflict (409 ``stale_call``): the node sent a later call that this or another tracker
                of the database applied already (:meth:`refuse_stale`).
            NotFound: a shard of an unknown model without a layer count.
        """
        record, old, row = self.begin_register(payload, sent_at, self.bind(payload.node_id, payload.public_key))
        saved, pins = self.register_store(record.node_id, row)
        return self.end_register(record, old, saved, pins)

    def bind(self, node_id: str, public_key: str) -> str:
        """The key ``node_id`` is bound to, binding it to ``public_key`` in the store at its first
        registration (ADR-0035); safe on a worker thread (the store, and dict writes)."""
        return self.bind_many([(node_id, public_key)])[0]

    def bind_many(self, pairs: list[tuple[str, str]]) -> list[str]:
        """:meth:`bind` of each ``(node_id, public_key)``, the store's part in one transaction (the
        tracker's app groups the registrations that arrive together, ADR-0063)."""
        unknown = [(node_id, key) for node_id, key in pairs if self._bound_keys.get(node_id) != key]
        for (node_id, _), bound in zip(unknown, self.store.bind_keys(unknown)):
            self._bound_keys[node_id] = bound  # its heartbeats' signatures are checked against it
        return [self._bound_keys[node_id] for node_id, _ in pairs]

    def begin_register(self, payload: RegisterRequest, sent_at: float,
                       bound: str) -> tuple[NodeRecord, NodeRecord | None, NodeRow | None]:
        """The in-memory part of a registration (on the event loop) once the id's key is ``bound``
        (:meth:`bind`): returns the new record, the one it replaces, and the shared record to write
        (None on sqlite). Raises as :meth:`register`."""
        node_id = payload.node_id
        if bound != payload.public_key:
            log.warning("refused a registration of %s with another key (endpoint %s)", node_id, payload.endpoint)
            raise Conflict(f"node id {node_id!r} belongs to another key; this registration is refused",
                           code="node_id_taken",
                           hint="a node keeps its key in its --state-dir (node.key): start it with the same "
                                "state dir, or choose another --node-id")
        # only the node's own calls are ordered by its clock: another key is refused above, whatever its time
        self.refuse_stale(node_id, sent_at)  # in memory; the record's conditional write settles the rest
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
        record.sent_at = sent_at
        self.nodes[node_id] = record
        self.verify_shards(record)
        self.dirty = True
        if old is None:
            self.last_join_s = time.monotonic()
        return record, old, self.record_row(record)

    def register_store(self, node_id: str, row: NodeRow | None) -> tuple[bool, list[dict]]:
        """A registration's store work (thread-safe: the store only): the shared record written
        (False: the stored one came from a later call of the node) and the node's pins read."""
        return self.register_stores([(node_id, row)])[0]

    def register_stores(self, items: list[tuple[str, NodeRow | None]]) -> list[tuple[bool, list[dict]]]:
        """:meth:`register_store` of each ``(node_id, row)``: the records in one transaction, the pins
        in one statement (the tracker's app groups the registrations that arrive together, ADR-0063)."""
        saved = iter(self.store.save_nodes([row for _, row in items if row is not None]))
        pins = self.store.pins_of(list(dict.fromkeys(node_id for node_id, _ in items)))
        return [(next(saved) if row is not None else True, pins.get(node_id, [])) for node_id, row in items]

    def end_register(self, record: NodeRecord, old: NodeRecord | None, saved: bool, pins: list[dict]) -> NodeRecord:
        """A registration's last part (on the event loop): undone when its record lost to a later
        call (:meth:`_forget_stale` raises), else the node's ``pins`` restored; returns the record."""
        if not saved:
            self._forget_stale(record.node_id, old)
        log.info("node %s registered at %s with %d shard(s)", record.node_id, record.endpoint, len(record.shards))
        self.restore_pins(record, pins)
        return record

    def get(self, node_id: NodeId) -> NodeRecord:
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

    def heartbeat(self, node_id: str, payload: HeartbeatRequest, sent_at: float = 0.0) -> list[Directive]:
        """Record a heartbeat; returns the directives to deliver (queued → delivered), all on the
        calling thread (tests, tools; the tracker's app runs :meth:`heartbeat_store` on a worker
        thread). ``sent_at``: as for :meth:`register`.

        Raises:
            NotFound: unknown node. Conflict (409 ``stale_call``): see :meth:`refuse_stale`.
        """
        write = self.begin_heartbeat(node_id, payload, sent_at)
        try:
            return self.heartbeat_store(write)
        except BaseException:
            self.undo_heartbeat(write)
            raise

    def begin_heartbeat(self, node_id: str, payload: HeartbeatRequest, sent_at: float = 0.0) -> "HeartbeatWrite":
        """The in-memory part of a heartbeat (on the event loop): the node's time, stats and shards;
        returns what is left for the store (:meth:`heartbeat_store`, safe on a worker thread).

        Raises:
            NotFound: unknown node. Conflict (409 ``stale_call``): see :meth:`refuse_stale`.
        """
        node = self.get(node_id)
        self.refuse_stale(node_id, sent_at)
        node.sent_at = max(node.sent_at, sent_at)
        node.last_heartbeat_s = time.monotonic()
        node.stats = payload.stats
        before = {(s.model, s.layers) for s in node.shards if node.admitted(s)}
        write = HeartbeatWrite(node_id, [(u.id, u.status, u.error) for u in payload.directive_updates],
                               shards_before=node.shards, record_at=node.record_at)
        node.shards = [ShardRecord.from_payload(s) for s in payload.shards]
        for s in payload.shards:
            self.ensure_model(s.model, s.num_layers)
        self.verify_shards(node)
        if before != {(s.model, s.layers) for s in node.shards if node.admitted(s)}:
            self.dirty = True
        if any(u.status in ("done", "failed") for u in payload.directive_updates):
            self.dirty = True
        write.row = self._heartbeat_row(node, bool(write.updates) or node.shards != write.shards_before)
        # the hint goes before the read: a directive queued after it is noted again for the next heartbeat
        write.deliver = node_id in self.queued_hint
        self.queued_hint.discard(node_id)
        return write

    def heartbeat_store(self, write: "HeartbeatWrite") -> list[Directive]:
        """A heartbeat's store work (thread-safe: the store only): its directive updates (only of
        its own directives) and record in one transaction, then its queued directives read and
        marked delivered in another. Returns them.

        Raises:
            StaleCall: another tracker applied a later call of the node; nothing was written.
            MeshnetError (503 ``database_unreachable``): the store did not answer.
        """
        self.store.set_statuses(write.updates, node_id=write.node_id, node=write.row)
        if not write.deliver:
            return []
        out = [d.model_copy(update={"status": "delivered"})
               for d in reversed(self.store.directives(node_id=write.node_id, statuses=("queued",)))]
        self.store.set_statuses([(d.id, "delivered", None) for d in out], node_id=write.node_id)
        return out

    def undo_heartbeat(self, write: "HeartbeatWrite") -> None:
        """After a failed :meth:`heartbeat_store` (on the event loop): the node keeps the shards the
        store holds (a stale call: what the later one wrote), and its directives are read again."""
        node = self.nodes.get(write.node_id)
        if node is not None:
            node.shards, node.record_at = write.shards_before, write.record_at
        if write.deliver:
            self.queued_hint.add(write.node_id)

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
        # a node silent past its dropout timeout is not written: the leader may have deleted its shared
        # record already, and a write would bring it back to every tracker (a frozen tracker resumed,
        # or a dropout check waiting on the store, probes it in the meantime)
        gone = self._gone(time.monotonic() if now is None else now)(node)
        row = self.record_row(node) if changed and not gone else None
        if row is not None:  # off the event loop: the probe's caller waits for nothing it writes
            self.write_soon(f"the record of {node_id}", self.store.save_node, row)

    def to_probe(self, now: float | None = None) -> list[NodeRecord]:
        """Unreachable nodes whose last probe is ``probe_interval_s`` old or more, and overdue
        ones (:meth:`dropout_deadline_s`) not probed since their last heartbeat."""
        now = time.monotonic() if now is None else now
        deadline_s = self.dropout_deadline_s()
        return [n for n in self.nodes.values()
                if (not n.reachable and (n.probed_s is None or now - n.probed_s >= self.settings.probe_interval_s))
                or (n.reachable and now - n.last_heartbeat_s > deadline_s
                    and (n.probed_s is None or n.probed_s <= n.last_heartbeat_s))]

    def dropout_deadline_s(self) -> float:
        """Seconds of silence after which a node is probed, and dropped at once when the probe
        fails, however long its heartbeat timeout: the timeout grows with the network
        (:mod:`meshnet.tracker.cadence`: 50 s at 10,000 nodes), this keeps dropout detection
        within :data:`~meshnet.tracker.cadence.MAX_DROPOUT_S` (30 s) at any size, less the probe's
        own timeout and two control-loop rounds (ADR-0054)."""
        return max(1.0, MAX_DROPOUT_S - self.settings.probe_timeout_s - 2.0)

    def public_key(self, node_id: str) -> str | None:
        """The public key bound to ``node_id`` (base64url), or None when the id was never registered.

        A binding never changes once made (another key is refused 409), so each is read from the
        store once and then served from memory: every heartbeat asks for it.
        """
        key = self._bound_keys.get(node_id)
        if key is None:
            key = self.store.node_key(node_id)  # a dict write below: safe from a worker thread too
            if key is not None:
                self._bound_keys[node_id] = key
        return key

    def known_key(self, node_id: str) -> str | None:
        """The key bound to ``node_id`` if this tracker holds it in memory (no store call)."""
        return self._bound_keys.get(node_id)

    def check_dropouts(self, now: float | None = None) -> list[str]:
        """Drop nodes whose last heartbeat is older than their timeout (:meth:`node_timeout_s`), and
        overdue ones (:meth:`dropout_deadline_s`) whose probe since their last heartbeat failed;
        returns their ids. None while :attr:`blind_until` holds (after the database was unreachable).
        All on the calling thread, store calls included (tests, tools; the control loop uses
        :meth:`check_dropouts_off_loop`)."""
        now = time.monotonic() if now is None else now
        gone = self._silent(now)
        if gone and self.store.shared:  # it may heartbeat to another tracker of this database
            gone = self._still_silent(gone, self.store.heartbeat_times([nid for nid, _ in gone]), now)
        ids = [nid for nid, _ in gone]
        write = self._forget_in_memory(ids)
        if write is not None:
            self.store.forget_nodes(ids, "node dropped out", **write)
        _log_dropouts(gone)
        return ids

    async def check_dropouts_off_loop(self, now: float | None = None) -> list[str]:
        """:meth:`check_dropouts` with its store calls on worker threads: the event loop never waits
        on the database (ADR-0059), and 5,000 nodes dropping out at once cost it only their
        in-memory part. A node that heartbeats or leaves while the store is read is not dropped.

        Raises:
            LeaseLost: this tracker lost the lease (the nodes are forgotten here, their directives
                left to the leader).
        """
        now = time.monotonic() if now is None else now
        gone = self._silent(now)
        if gone and self.store.shared:
            elsewhere = await asyncio.to_thread(self.store.heartbeat_times, [nid for nid, _ in gone])
            gone = self._still_silent(gone, elsewhere, now)
        ids = [nid for nid, _ in gone]
        write = self._forget_in_memory(ids)
        if write is not None:
            await asyncio.to_thread(self.store.forget_nodes, ids, "node dropped out", **write)
        _log_dropouts(gone)
        return ids

    def _gone(self, now: float):
        """The dropout test at monotonic time ``now``: silent past its timeout, or overdue and its
        probe since its last heartbeat failed."""
        floor_s = self.cadence().timeout_s  # once per check, not once per node
        deadline_s = self.dropout_deadline_s()

        def is_gone(n: NodeRecord) -> bool:
            silent = now - n.last_heartbeat_s
            return silent > self.node_timeout_s(n, floor_s) or (
                silent > deadline_s and not n.reachable and n.probed_s is not None and n.probed_s > n.last_heartbeat_s)
        return is_gone

    def _silent(self, now: float) -> list[tuple[str, float]]:
        """``(node id, seconds silent)`` of the nodes that look gone now (none while blind)."""
        if now < self.blind_until:  # the database was unreachable: heartbeats others heard are not in yet
            return []
        is_gone = self._gone(now)
        return [(nid, now - n.last_heartbeat_s) for nid, n in self.nodes.items() if is_gone(n)]

    def _still_silent(self, gone: list[tuple[str, float]], elsewhere: dict[str, float],
                      now: float) -> list[tuple[str, float]]:
        """``gone`` less the nodes that heartbeat to another tracker of the database (their unix
        heartbeat times ``elsewhere``) or that left or heartbeat here meanwhile."""
        wall = time.time()
        for nid, at in elsewhere.items():
            node = self.nodes.get(nid)
            if node is not None:
                node.last_heartbeat_s = max(node.last_heartbeat_s, now - (wall - at))
        is_gone = self._gone(now)
        return [(nid, now - self.nodes[nid].last_heartbeat_s) for nid, _ in gone
                if nid in self.nodes and is_gone(self.nodes[nid])]

    def deregister(self, node_id: NodeId) -> None:
        """Forget a node that leaves on purpose (end of its drain); its open directives fail.

        Raises:
            NotFound: unknown node.
        """
        self.get(node_id)
        self._forget([node_id], "node deregistered", final=True)
        log.info("node %s deregistered", node_id)

    async def deregister_off_loop(self, node_id: NodeId) -> None:
        """:meth:`deregister` with the store's part on a worker thread (the node's call to leave).

        Raises:
            NotFound: unknown node.
        """
        self.get(node_id)
        write = self._forget_in_memory([node_id], final=True)
        await asyncio.to_thread(self.store.forget_nodes, [node_id], "node deregistered", **write)
        log.info("node %s deregistered", node_id)

    def _forget(self, node_ids: list[str], why: str, *, final: bool = False) -> None:
        """Forget ``node_ids`` (:meth:`_forget_in_memory`) and tell the store on the calling thread."""
        write = self._forget_in_memory(node_ids, final=final)
        if write is not None:
            self.store.forget_nodes(node_ids, why, **write)

    def _forget_in_memory(self, node_ids: list[str], *, final: bool = False) -> dict | None:
        """Forget ``node_ids`` here; returns the keyword arguments of the store write that goes with
        it, or None. Their open directives fail and their shared records go, in one store
        transaction (:meth:`TrackerStore.forget_nodes`: 1,000 dropouts at once held the event loop
        1.3 s on PostgreSQL as a transaction or two a node), when this tracker leads or the nodes left
        on purpose (``final``); a standby that stopped hearing from a node only forgets it, since the
        leader decides dropouts (ADR-0043)."""
        if not node_ids:
            return None
        gone = set(node_ids)
        for node_id in node_ids:
            del self.nodes[node_id]
            self._heartbeats.pop(node_id, None)
        self.verdicts = {k: v for k, v in self.verdicts.items() if k[0] not in gone}
        self.dirty = True
        if not (self.leader or final):
            return None
        # a dropout is the leader's decision: fenced by its lease term
        return {"delete_records": self.store.shared, "term": None if final else self.store.term}

    def node_row(self, node: NodeRecord) -> NodeRow:
        """``node``'s shared record, heard of now."""
        return NodeRow(node.node_id, record_to_json(node), node.record_at, time.time(), node.sent_at)

    def save(self, node: NodeRecord) -> bool:
        """Write ``node``'s record for the other trackers of a shared store (nothing on sqlite);
        False when the stored one came from a later call of the node (ADR-0054)."""
        row = self.record_row(node)
        return self.store.save_node(row) if row is not None else True

    def record_row(self, node: NodeRecord) -> NodeRow | None:
        """``node``'s record to write now for the other trackers of a shared store (None on sqlite)."""
        if not self.store.shared:
            return None
        node.record_at = time.time()
        self._heartbeats.pop(node.node_id, None)
        return self.node_row(node)

    def refuse_stale(self, node_id: str, sent_at: float) -> None:
        """Refuse a node's call signed before one this tracker applied: a call that waited in a
        frozen tracker's socket while the node moved on must not undo what it did since (ADR-0054;
        a call another tracker of a shared store applied is caught by the record's conditional
        write, :meth:`TrackerStore.save_node`). ``sent_at`` 0 (an unsigned, in-process call) is
        never refused.

        Raises:
            StaleCall (409 ``stale_call``): the call is older than the last applied one.
        """
        if not sent_at:
            return
        node = self.nodes.get(node_id)
        latest = node.sent_at if node is not None else 0.0
        if sent_at < latest:
            log.warning("refused a call of %s signed %.1f s before one already applied (it waited in this "
                        "tracker while the node moved on)", node_id, latest - sent_at)
            raise StaleCall(f"call of {node_id} signed {latest - sent_at:.1f} s before its latest applied call")

    def _forget_stale(self, node_id: str, old: NodeRecord | None) -> None:
        """Undo a registration whose record write lost to a later call of the node (another
        tracker wrote it between :meth:`refuse_stale` and the write).

        Raises:
            StaleCall: always.
        """
        if old is None:
            self.nodes.pop(node_id, None)
        else:
            self.nodes[node_id] = old
        log.warning("refused a call of %s: another tracker applied a later one (it waited in this tracker "
                    "while the node moved on)", node_id)
        raise StaleCall(f"registration of {node_id} is older than its stored record")

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
