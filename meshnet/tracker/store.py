"""Tracker state in a SQL database: one interface, two backends (ADR-0037, ADR-0043).

:class:`TrackerStore` holds every statement; the backends differ only in how they connect, the
column types of the schema, the placeholder (``?`` for sqlite, ``%s`` for psycopg, converted
once per statement) and how they lead:

:func:`meshnet.tracker.backends.open_store` picks one for ``--db``:

- :class:`SqliteStore` (the embedded default, a file or ``:memory:``): one tracker process per
  database, which always leads.
- :class:`meshnet.tracker.pgstore.PostgresStore` (``--db postgresql://...``): several tracker
  processes share the database; one leads (an advisory lock) and the others stand by.

What only the tracker knows lives here: operator pins, the directive queue, the tracked models,
which public key owns each node id (ADR-0035), the demand events, the quarantines and the
known weights digests (ADR-0042: a restart must neither lift a quarantine nor let the first node
to register again set the digest its peers are held to), and (on a shared database)
the node records every tracker reads, so that a standby knows the whole network when it takes
over. An open ``LOAD_SHARD``/``DROP_SHARD`` is unique per node, model and range (a partial
unique index): queueing it again is a no-op, whichever tracker queues it.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.errors import Conflict, MeshnetError
from meshnet.protocol.control import OPEN_STATUSES, Directive

__all__ = ["FINISHED_STATUSES", "OPEN_STATUSES", "DemandEvent", "LeaseLost", "NewDirective", "NodeRow",
           "SqliteStore", "StaleCall", "TrackerStore"]

#: the schema; ``{id}`` and ``{real}`` are the backend's auto-increment key and float column types
SCHEMA = """
CREATE TABLE IF NOT EXISTS directives (
  id {id}, node_id TEXT NOT NULL, type TEXT NOT NULL,
  model TEXT, shard_start INTEGER, shard_end INTEGER, tier TEXT, status TEXT NOT NULL,
  error TEXT, reason TEXT, created_at {real} NOT NULL, updated_at {real} NOT NULL);
CREATE TABLE IF NOT EXISTS pins (
  node_id TEXT NOT NULL, model TEXT NOT NULL, shard_start INTEGER, shard_end INTEGER,
  created_at {real} NOT NULL, PRIMARY KEY (node_id, model));
CREATE TABLE IF NOT EXISTS models (name TEXT PRIMARY KEY, added_at {real} NOT NULL, source TEXT);
CREATE TABLE IF NOT EXISTS node_keys (node_id TEXT PRIMARY KEY, public_key TEXT NOT NULL, bound_at {real} NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
  node_id TEXT PRIMARY KEY, record TEXT NOT NULL, record_at {real} NOT NULL, heartbeat_at {real} NOT NULL,
  sent_at {real} NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS demand (
  id {id}, model TEXT NOT NULL, kind TEXT NOT NULL, at {real} NOT NULL, origin TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tracker_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS hop_failures (id {id}, node_id TEXT NOT NULL, at {real} NOT NULL, origin TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS quarantines (node_id TEXT PRIMARY KEY, record TEXT NOT NULL, since {real} NOT NULL);
CREATE TABLE IF NOT EXISTS digests (shard_key TEXT PRIMARY KEY, digest TEXT NOT NULL, known_at {real} NOT NULL);
-- what every heartbeat reads (a node's queued directives) and what rebalance and pruning read
-- (directives by status, finished ones by age); IF NOT EXISTS adds them to older databases (ADR-0037)
CREATE INDEX IF NOT EXISTS directives_by_node_status ON directives (node_id, status);
CREATE INDEX IF NOT EXISTS directives_by_status ON directives (status, updated_at);
CREATE INDEX IF NOT EXISTS nodes_by_record_at ON nodes (record_at);
CREATE INDEX IF NOT EXISTS demand_by_at ON demand (at);
CREATE INDEX IF NOT EXISTS hop_failures_by_at ON hop_failures (at);
"""

#: one open load or drop per node, model and range, whichever tracker queues it (ADR-0043)
OPEN_ONCE = ("CREATE UNIQUE INDEX IF NOT EXISTS directives_open_once ON directives "
             "(node_id, type, model, shard_start, shard_end) "
             "WHERE status IN ('queued', 'delivered', 'acked') AND type IN ('LOAD_SHARD', 'DROP_SHARD')")
#: an older database may hold duplicates the index would refuse: all but the oldest fail first
_FAIL_DUPLICATES = ("UPDATE directives SET status = 'failed', error = 'duplicate open directive' "
                    "WHERE status IN ('queued', 'delivered', 'acked') AND type IN ('LOAD_SHARD', 'DROP_SHARD') "
                    "AND id NOT IN (SELECT MIN(id) FROM directives WHERE status IN ('queued', 'delivered', 'acked') "
                    "AND type IN ('LOAD_SHARD', 'DROP_SHARD') GROUP BY node_id, type, model, shard_start, shard_end)")

#: statuses of a finished directive, pruned after the retention period (ADR-0037)
FINISHED_STATUSES = ("done", "failed")

_INSERT_DIRECTIVE = ("INSERT INTO directives (node_id, type, model, shard_start, shard_end, tier, status, reason, "
                     "created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING RETURNING id")
_OPEN_TWIN = ("SELECT * FROM directives WHERE node_id = ? AND type = ? AND model = ? AND shard_start = ? "
              "AND shard_end = ? AND status IN ('queued', 'delivered', 'acked')")


class LeaseLost(MeshnetError):
    """A planning write carried a lease term this tracker no longer holds: another tracker
    leads now, or the lease expired (ADR-0054). Nothing of the write was kept (503 ``lease_lost``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="lease_lost", status=503,
                         hint="this tracker stopped leading; the current leader plans instead")


#: the longest a store call waits for another call on the same connection (a worker thread's
#: batch write, or a call stuck on an unreachable database) before it gives up, seconds: the
#: event loop calls the store too, and must not wait out a network deadline (ADR-0054). A
#: 10,000-node rebalance's batch write takes well under a second.
LOCK_WAIT_S = 2.0


class DeadlineLock:
    """A mutex whose ``with`` waits at most ``wait_s`` seconds.

    Raises:
        MeshnetError (503 ``database_unreachable``): not acquired in time.
    """

    def __init__(self, wait_s: float = LOCK_WAIT_S) -> None:
        self.wait_s = wait_s
        self._lock = threading.Lock()

    def __enter__(self) -> "DeadlineLock":
        if not self._lock.acquire(timeout=self.wait_s):
            raise MeshnetError(f"the tracker database has not answered another call for {self.wait_s:.0f} s",
                               code="database_unreachable", status=503,
                               hint="try again shortly, or another tracker of this network")
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


class StaleCall(Conflict):
    """A node's call signed before one of its calls that a tracker of this database applied
    already: it waited (in a frozen tracker's socket) while the node moved on (ADR-0054).
    Nothing of it was kept (409 ``stale_call``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="stale_call",
                         hint="a later call of this node was applied already; nothing changed")


@dataclass(frozen=True)
class NewDirective:
    """A directive to queue (inclusive ``shard_start``/``shard_end`` as stored; None for RUN_DOCTOR / RELOAD)."""

    node_id: str
    type: str
    model: str | None = None
    shard_start: int | None = None
    shard_end: int | None = None
    tier: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class NodeRow:
    """A node's record as trackers on one database share it (ADR-0043).

    ``record``: the record as JSON text (:func:`meshnet.tracker.registry.record_to_json`);
    ``record_at``: unix time the record last changed; ``heartbeat_at``: unix time of the node's
    latest heartbeat at any tracker; ``sent_at``: the signed time (the node's clock) of the call
    that wrote the record (ADR-0054: an older call never overwrites it; 0: unordered)."""

    node_id: str
    record: str
    record_at: float
    heartbeat_at: float
    sent_at: float = 0.0


@dataclass(frozen=True)
class DemandEvent:
    """One chat request counted for placement: ``kind`` is ``refused`` (queued demand, the model
    was not routable) or ``served`` (forwarded to an entry node); ``at`` unix time; ``origin`` the
    tracker process that counted it."""

    model: str
    kind: str
    at: float
    origin: str
    id: int = 0


class TrackerStore:
    """The store's interface and its shared SQL. Thread-safe: every method takes :attr:`lock` for
    its whole statement or transaction, so a thread (the rebalance's batched write, the pruning)
    and the event loop never interleave inside one. Directives come back as :class:`Directive`,
    other rows as dicts or the dataclasses above.

    A backend sets :attr:`db` (a DB-API connection in autocommit mode whose rows read as
    mappings) and implements :meth:`_insert_returning_many`, :meth:`tracker_key` and :meth:`lead`.
    """

    #: several tracker processes may use this database at once (so node records are shared)
    shared = False
    #: the exception a broken constraint (NOT NULL, ...) raises
    IntegrityError: type[Exception] = sqlite3.IntegrityError
    #: what a call raises while the database cannot be reached or its connection broke: the
    #: tracker answers 503 ``database_unreachable`` and carries on (ADR-0054)
    database_errors: tuple[type[Exception], ...] = (sqlite3.OperationalError,)
    placeholder = "?"

    def __init__(self) -> None:
        self.lock = DeadlineLock()
        self._sql_cache: dict[str, str] = {}
        #: the lease term this process leads under (the fencing token of its planning writes);
        #: None where it does not lead, or where only one tracker uses the database (ADR-0054)
        self.term: int | None = None

    def _sql(self, sql: str) -> str:
        """``sql`` with this backend's placeholder."""
        if self.placeholder == "?":
            return sql
        out = self._sql_cache.get(sql)
        if out is None:
            out = self._sql_cache[sql] = sql.replace("?", self.placeholder)
        return out

    def _execute(self, sql: str, args: tuple | list = ()):
        return self.db.execute(self._sql(sql), args)

    @contextlib.contextmanager
    def _transaction(self):
        """One transaction under the store's lock: committed when the block ends, rolled back whole
        when it raises."""
        with self.lock:
            self.db.execute("BEGIN")
            try:
                yield
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def _fenced(self, term: int | None):
        """The block of one planning write of a single statement: under the store's lock alone
        without a ``term`` (one statement is atomic), else in a transaction that first checks
        the term (:meth:`_check_term`, ADR-0054).

        Raises:
            LeaseLost: ``term`` is no longer this process's lease.
        """
        if term is None:
            with self.lock:
                yield
            return
        with self._transaction():
            self._check_term(term)
            yield

    def _rows(self, sql: str, args: tuple = ()) -> list[dict]:
        with self.lock:
            return [dict(r) for r in self._execute(sql, args).fetchall()]

    def _exec(self, sql: str, args: tuple = ()) -> int:
        """Run one statement; returns how many rows it changed."""
        with self.lock:
            return self._execute(sql, args).rowcount

    def _executemany(self, sql: str, rows: list[tuple]) -> None:
        self.db.executemany(self._sql(sql), rows)

    def _insert_returning_many(self, sql: str, rows: list[tuple]) -> list[int | None]:
        """Run ``sql`` (an INSERT ... RETURNING id) once per row inside the caller's transaction;
        the id of each row, None where a conflict skipped it."""
        out = []
        for row in rows:
            got = self._execute(sql, row).fetchone()
            out.append(None if got is None else got["id"])
        return out

    def close(self) -> None:
        """Close the connection(s); the store is unusable afterwards."""
        self.db.close()

    def reconnect(self) -> None:
        """Open the connection again if it broke (a worker thread calls it every sync round; a
        no-op where the database is a local file)."""

    # leadership (ADR-0043)
    def lead(self) -> bool:
        """Whether this process leads now (plans and issues directives); tries to become leader
        when it does not. Cheap enough to call every second."""
        raise NotImplementedError

    def resign(self) -> None:
        """Stop leading, so that another tracker of this database may take over (no-op where
        only one tracker uses it)."""

    def lease_valid(self) -> bool:
        """Whether this process may act as leader right now, between two calls of :meth:`lead`
        (always, where only one tracker uses the database)."""
        return True

    def _check_term(self, term: int | None) -> None:
        """Inside a planning write's transaction: refuse it unless ``term`` is still this
        process's lease (a no-op where only one tracker uses the database).

        Raises:
            LeaseLost: the write's term is no longer the lease's.
        """

    def tracker_key(self) -> Ed25519PrivateKey:
        """The key that signs session tickets, the same for every tracker of this database (ADR-0038)."""
        raise NotImplementedError

    # directives
    def add_directive(self, node_id: str, type_: str, *, model: str | None = None, shard_start: int | None = None,
                      shard_end: int | None = None, tier: str | None = None, reason: str = "") -> Directive:
        """Queue one directive; returns its row, or the identical load/drop still open for the node
        (queueing it again is a no-op)."""
        new = NewDirective(node_id, type_, model, shard_start, shard_end, tier, reason)
        rid = self.add_directives([new])[0]
        if rid is None:
            rows = self._rows(_OPEN_TWIN, (node_id, type_, model, shard_start, shard_end))
            return Directive.model_validate(rows[0])
        return self.directive(rid)

    def add_directives(self, new: list[NewDirective], *, term: int | None = None) -> list[int | None]:
        """Queue many directives in one transaction (one commit, whatever their number); returns
        their ids in the order given, None for a load or drop skipped because the identical one is
        still open for the node (ADR-0043). A failure rolls the whole batch back and re-raises
        (:attr:`IntegrityError` for a broken constraint; :class:`LeaseLost` when ``term``, the
        planner's lease term, is no longer this process's lease, ADR-0054). Safe to call from a
        worker thread (rebalance does, ADR-0037)."""
        if not new:
            return []
        now = time.time()
        rows = [(d.node_id, d.type, d.model, d.shard_start, d.shard_end, d.tier, "queued", d.reason, now, now)
                for d in new]
        with self._transaction():
            self._check_term(term)
            return self._insert_returning_many(_INSERT_DIRECTIVE, rows)

    def prune_finished(self, older_than_s: float, now: float | None = None) -> int:
        """Delete finished directives (:data:`FINISHED_STATUSES`) last updated more than
        ``older_than_s`` seconds ago (unix time ``now``, default the clock); open ones always stay.
        Returns how many rows were deleted."""
        cutoff = (time.time() if now is None else now) - older_than_s
        marks = ",".join("?" * len(FINISHED_STATUSES))
        return self._exec(f"DELETE FROM directives WHERE status IN ({marks}) AND updated_at < ?",
                          (*FINISHED_STATUSES, cutoff))

    def fail_open(self, node_id: str, error: str, *, term: int | None = None) -> int:
        """Mark every open directive of ``node_id`` failed with ``error`` in one statement; returns
        how many. ``term``: the leader's lease term, as for :meth:`add_directives`.

        Raises:
            LeaseLost: ``term`` is no longer this process's lease (nothing changed).
        """
        marks = ",".join("?" * len(OPEN_STATUSES))
        with self._fenced(term):
            return self._execute(f"UPDATE directives SET status = 'failed', error = ?, updated_at = ? "
                                 f"WHERE node_id = ? AND status IN ({marks})",
                                 (error, time.time(), node_id, *OPEN_STATUSES)).rowcount

    def directive(self, directive_id: int) -> Directive | None:
        rows = self._rows("SELECT * FROM directives WHERE id = ?", (directive_id,))
        return Directive.model_validate(rows[0]) if rows else None

    def directives(self, *, node_id: str | None = None, statuses: tuple[str, ...] | None = None,
                   updated_after: float | None = None, limit: int = 500) -> list[Directive]:
        """Directives, newest first (rows were validated when queued, so they are not re-validated);
        ``updated_after``: only those last updated after this unix time."""
        sql, args = "SELECT * FROM directives WHERE 1=1", []
        if node_id:
            sql += " AND node_id = ?"
            args.append(node_id)
        if statuses:
            sql += f" AND status IN ({','.join('?' * len(statuses))})"
            args.extend(statuses)
        if updated_after is not None:
            sql += " AND updated_at > ?"
            args.append(updated_after)
        sql += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        return [Directive.model_construct(**row) for row in self._rows(sql, tuple(args))]

    def nodes_with_queued(self) -> list[str]:
        """Ids of the nodes that have a queued (not yet delivered) directive."""
        return [r["node_id"] for r in self._rows("SELECT DISTINCT node_id FROM directives WHERE status = 'queued'")]

    def set_status(self, directive_id: int, status: str, error: str | None = None) -> None:
        self._exec("UPDATE directives SET status = ?, error = ?, updated_at = ? WHERE id = ?",
                   (status, error, time.time(), directive_id))

    def set_statuses(self, updates: list[tuple[int, str, str | None]], *, node_id: str,
                     node: NodeRow | None = None) -> None:
        """Apply ``(directive id, status, error)`` updates to directives of ``node_id`` in one
        transaction (one commit): what a heartbeat reports and delivers (ADR-0037). An id of
        another node's directive, or an unknown one, changes nothing. ``node``: the node's record,
        written in the same transaction (a shared database: a finished load and the shard it
        brought are seen together, ADR-0043).

        Raises:
            StaleCall: the stored record came from a later call of the node; nothing was written.
        """
        if not updates and node is None:
            return
        now = time.time()
        with self._transaction():
            if updates:
                self._executemany("UPDATE directives SET status = ?, error = ?, updated_at = ? "
                                  "WHERE id = ? AND node_id = ?",
                                  [(status, error, now, i, node_id) for i, status, error in updates])
            if node is not None and not self._save_node(node):
                raise StaleCall(f"heartbeat of {node_id} is older than its stored record")

    # pins
    def add_pin(self, node_id: str, model: str, shard_start: int | None, shard_end: int | None) -> None:
        self._exec("INSERT INTO pins VALUES (?,?,?,?,?) ON CONFLICT (node_id, model) DO UPDATE SET "
                   "shard_start = excluded.shard_start, shard_end = excluded.shard_end, created_at = excluded.created_at",
                   (node_id, model, shard_start, shard_end, time.time()))

    def pins(self, node_id: str | None = None) -> list[dict]:
        """Operator pins (all, or one node's), oldest first: ``{node_id, model, shard_start, shard_end}``."""
        if node_id is None:
            return self._rows("SELECT * FROM pins ORDER BY created_at")
        return self._rows("SELECT * FROM pins WHERE node_id = ? ORDER BY created_at", (node_id,))

    def remove_pin(self, node_id: str, model: str) -> bool:
        """Delete the pin of ``model`` on ``node_id``; True when there was one."""
        return self._exec("DELETE FROM pins WHERE node_id = ? AND model = ?", (node_id, model)) > 0

    def _first_wins(self, table: str, key: str, column: str, row: tuple) -> str:
        """Insert ``row`` (key first, ``column`` second) into ``table`` unless its key is there; returns
        ``column`` of the row in force (the earlier one when there was one), in one locked step."""
        with self.lock:
            inserted = self._execute(f"INSERT INTO {table} VALUES ({','.join('?' * len(row))}) ON CONFLICT DO NOTHING "
                                     f"RETURNING {column}", row).fetchone()
            if inserted is not None:  # the usual case, a first registration: one statement
                return inserted[column]
            return self._execute(f"SELECT {column} FROM {table} WHERE {key} = ?", (row[0],)).fetchone()[column]

    # node keys (ADR-0035)
    def bind_key(self, node_id: str, public_key: str) -> str:
        """Bind ``node_id`` to ``public_key`` unless it is bound already; returns the key it is bound
        to now (the earlier one when there was one: first registration wins, on any tracker)."""
        return self._first_wins("node_keys", "node_id", "public_key", (node_id, public_key, time.time()))

    def node_key(self, node_id: str) -> str | None:
        """The public key bound to ``node_id`` (base64url), or None."""
        rows = self._rows("SELECT public_key FROM node_keys WHERE node_id = ?", (node_id,))
        return rows[0]["public_key"] if rows else None

    # models
    def add_model(self, name: str, source: str = "operator") -> None:
        self._exec("INSERT INTO models VALUES (?,?,?) ON CONFLICT DO NOTHING", (name, time.time(), source))

    def model_sources(self) -> dict[str, str]:
        """Model name → how it became tracked: ``operator`` (``--model``/pin) or ``demand``."""
        return {r["name"]: r["source"] for r in self._rows("SELECT name, source FROM models")}

    def models(self) -> list[str]:
        return [r["name"] for r in self._rows("SELECT name FROM models ORDER BY added_at, name")]

    # node records, shared by the trackers of one database (ADR-0043)
    def _save_node(self, row: NodeRow) -> bool:
        return self._execute(
            "INSERT INTO nodes (node_id, record, record_at, heartbeat_at, sent_at) VALUES (?,?,?,?,?) "
            "ON CONFLICT (node_id) DO UPDATE SET record = excluded.record, record_at = excluded.record_at, "
            "heartbeat_at = excluded.heartbeat_at, sent_at = excluded.sent_at "
            "WHERE excluded.sent_at = 0 OR nodes.sent_at <= excluded.sent_at",
            (row.node_id, row.record, row.record_at, row.heartbeat_at, row.sent_at)).rowcount > 0

    def save_node(self, row: NodeRow) -> bool:
        """Write (insert or replace) one node's record, unless the stored one came from a later
        call of the node (``sent_at``, ADR-0054); returns whether it was written."""
        with self.lock:
            return self._save_node(row)

    def touch_nodes(self, heartbeats: dict[str, float]) -> None:
        """Record the latest heartbeat (unix time) of many nodes in one transaction; a time older
        than the stored one changes nothing."""
        if heartbeats:
            with self._transaction():
                self._executemany("UPDATE nodes SET heartbeat_at = ? WHERE node_id = ? AND heartbeat_at < ?",
                                  [(at, node_id, at) for node_id, at in heartbeats.items()])

    def nodes_changed(self, since: float) -> list[NodeRow]:
        """Node records changed at or after unix time ``since`` (0: all)."""
        return [NodeRow(**r) for r in self._rows("SELECT * FROM nodes WHERE record_at >= ?", (since,))]

    def heartbeat_times(self, node_ids: list[str]) -> dict[str, float]:
        """The latest heartbeat (unix time) of each of ``node_ids`` that has a record."""
        if not node_ids:
            return {}
        marks = ",".join("?" * len(node_ids))
        return {r["node_id"]: r["heartbeat_at"]
                for r in self._rows(f"SELECT node_id, heartbeat_at FROM nodes WHERE node_id IN ({marks})",
                                    tuple(node_ids))}

    def delete_node(self, node_id: str, *, term: int | None = None) -> None:
        """Forget a node's record (it dropped out or left). ``term``: the leader's lease term, as
        for :meth:`add_directives`.

        Raises:
            LeaseLost: ``term`` is no longer this process's lease (nothing changed).
        """
        with self._fenced(term):
            self._execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))

    # quarantines (ADR-0042)
    def add_quarantine(self, node_id: str, record: str, since: float) -> str:
        """Quarantine ``node_id`` with ``record`` (the evidence as JSON text) at unix time ``since``
        unless it is quarantined already; returns the record it is quarantined with now (the earlier
        one when there was one: the first evidence stays, on any tracker)."""
        return self._first_wins("quarantines", "node_id", "record", (node_id, record, since))

    def remove_quarantine(self, node_id: str) -> bool:
        """Lift ``node_id``'s quarantine; True when there was one."""
        return self._exec("DELETE FROM quarantines WHERE node_id = ?", (node_id,)) > 0

    def quarantines(self) -> dict[str, str]:
        """Every quarantined node id → its record (JSON text), oldest first."""
        return {r["node_id"]: r["record"] for r in self._rows("SELECT node_id, record FROM quarantines ORDER BY since")}

    # known weights digests (ADR-0042)
    def learn_digest(self, shard_key: str, digest: str) -> str:
        """Record ``digest`` as the weights digest of ``shard_key`` (model, exact range and recipe, as
        text) unless one is known already; returns the one known now (first one wins, on any tracker)."""
        return self._first_wins("digests", "shard_key", "digest", (shard_key, digest, time.time()))

    def known_digest(self, shard_key: str) -> str | None:
        """The weights digest known for ``shard_key``, or None."""
        rows = self._rows("SELECT digest FROM digests WHERE shard_key = ?", (shard_key,))
        return rows[0]["digest"] if rows else None

    # demand events (ADR-0043)
    def add_demand_event(self, event: DemandEvent) -> int:
        """Store one demand event; returns its id."""
        with self.lock:
            return self._execute("INSERT INTO demand (model, kind, at, origin) VALUES (?,?,?,?) RETURNING id",
                                 (event.model, event.kind, event.at, event.origin)).fetchone()["id"]

    def demand_events(self, *, after_id: int = 0, since: float = 0.0, not_from: str = "") -> list[DemandEvent]:
        """Demand events with an id over ``after_id`` and a time at or after ``since``, oldest
        first, except those counted by tracker ``not_from``."""
        rows = self._rows("SELECT * FROM demand WHERE id > ? AND at >= ? AND origin != ? ORDER BY id",
                          (after_id, since, not_from))
        return [DemandEvent(**r) for r in rows]

    def prune_demand(self, older_than: float) -> int:
        """Delete demand events (and hop failures) before unix time ``older_than``; returns how many
        demand events."""
        self._exec("DELETE FROM hop_failures WHERE at < ?", (older_than,))
        return self._exec("DELETE FROM demand WHERE at < ?", (older_than,))

    # hop failures, shared by the trackers of one database (ADR-0054)
    def add_hop_failure(self, node_id: str, at: float, origin: str) -> int:
        """Store one reported hop failure of ``node_id`` at unix time ``at``, heard by tracker
        ``origin``; returns its id."""
        with self.lock:
            return self._execute("INSERT INTO hop_failures (node_id, at, origin) VALUES (?,?,?) RETURNING id",
                                 (node_id, at, origin)).fetchone()["id"]

    def hop_failures(self, *, after_id: int = 0, since: float = 0.0, not_from: str = "") -> list[dict]:
        """Hop failures (``id``, ``node_id``, ``at``) with an id over ``after_id`` and a time at or
        after ``since``, oldest first, except those heard by tracker ``not_from``."""
        return self._rows("SELECT id, node_id, at FROM hop_failures WHERE id > ? AND at >= ? AND origin != ? "
                          "ORDER BY id", (after_id, since, not_from))


class SqliteStore(TrackerStore):
    """The embedded store: a sqlite file, or ``":memory:"`` (tests). One tracker process per file;
    it always leads. Its ticket key lives next to the file (``tracker.key``, ADR-0038)."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        super().__init__()
        self.path = str(path)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        with self.lock:
            self.db.executescript(SCHEMA.format(id="INTEGER PRIMARY KEY AUTOINCREMENT", real="REAL"))
            if "sent_at" not in {r["name"] for r in self.db.execute("PRAGMA table_info(nodes)")}:  # older file
                self.db.execute("ALTER TABLE nodes ADD COLUMN sent_at REAL NOT NULL DEFAULT 0")
            self.db.execute(_FAIL_DUPLICATES)
            self.db.execute(OPEN_ONCE)

    def lead(self) -> bool:
        return True

    def tracker_key(self) -> Ed25519PrivateKey:
        from meshnet.tracker.tickets import load_tracker_key
        return load_tracker_key(self.path)

