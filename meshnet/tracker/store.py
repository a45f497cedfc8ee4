"""Tracker state in a SQL database: one interface, two backends (ADR-0037, ADR-0043).

:class:`TrackerStore` holds every statement; the backends differ only in how they connect, the
column types of the schema, the placeholder (``?`` for sqlite, ``%s`` for psycopg, converted
once per statement) and how they lead:

:func:`meshnet.tracker.backends.open_store` picks one for ``--db``:

- :class:`SqliteStore` (the embedded default, a file or ``:memory:``): one tracker process per
  database, which always leads.
- :class:`meshnet.tracker.pgstore.PostgresStore` (``--db postgresql://...``): several tracker
  processes share the database; one leads (a lease, ADR-0054) and the others stand by.

What only the tracker knows lives here (the schema and the small shared tables in
:mod:`meshnet.tracker.tables`): operator pins, the directive queue, the tracked models,
which public key owns each node id (ADR-0035), the demand events, the quarantines and the
known weights digests (ADR-0042: a restart must neither lift a quarantine nor let the first node
to register again set the digest its peers are held to), and (on a shared database)
the node records every tracker reads, so that a standby knows the whole network when it takes
over. An open ``LOAD_SHARD``/``DROP_SHARD`` is unique per node, model and range (a partial
unique index): queueing it again is a no-op, whichever tracker queues it.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.errors import Conflict, MeshnetError
from meshnet.protocol.control import OPEN_STATUSES, Directive
from meshnet.tracker.tables import _APPEND_VALUES, _FAIL_DUPLICATES, _INSERT_VALUES, INSERT_CHUNK, OPEN_ONCE, SCHEMA, SharedRecords, \
    matched_ids

__all__ = ["FINISHED_STATUSES", "OPEN_STATUSES", "LeaseLost", "NewDirective", "NodeRow",
           "SqliteStore", "StaleCall", "TrackerStore"]

#: statuses of a finished directive, pruned after the retention period (ADR-0037)
FINISHED_STATUSES = ("done", "failed")

_OPEN_TWIN = ("SELECT * FROM directives WHERE node_id = ? AND type = ? AND model = ? AND shard_start = ? "
              "AND shard_end = ? AND status IN ('queued', 'delivered', 'acked')")


class LeaseLost(MeshnetError):
    """A planning write carried a lease term this tracker no longer holds: another tracker
    leads now, or the lease expired (ADR-0054). Nothing of the write was kept (503 ``lease_lost``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="lease_lost", status=503,
                         hint="this tracker stopped leading; the current leader plans instead")


#: nodes per statement of :meth:`TrackerStore.forget_nodes` on sqlite (one bound value each, within its
#: 32,766 variables a statement; PostgreSQL takes the ids as one array)
FORGET_CHUNK = 5000

#: the longest a store call waits for another call on the same connection (a worker thread's
#: batch write, or a call stuck on an unreachable database) before it gives up, seconds: the
#: event loop calls the store too, and must not wait out a network deadline (ADR-0054). A
#: 10,000-node rebalance's batch write takes well under a second.
LOCK_WAIT_S = 2.0


@functools.lru_cache(maxsize=512)
def _with_placeholder(sql: str, placeholder: str) -> str:
    """``sql`` with ``placeholder`` for ``?``, the recent ones remembered: bounded, since statements
    over a list of ids (pins, heartbeat times, dropouts) differ with the list's length."""
    return sql.replace("?", placeholder)


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


class NewDirective(NamedTuple):
    """A directive to queue (inclusive ``shard_start``/``shard_end`` as stored; None for RUN_DOCTOR / RELOAD).
    A named tuple: a rebalance of a large network makes thousands at once (as :class:`NodeState`)."""

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


class TrackerStore(SharedRecords):
    """The store's interface and its shared SQL. Thread-safe: every method takes :attr:`lock` for
    its whole statement or transaction, so a thread (the rebalance's batched write, the pruning)
    and the event loop never interleave inside one. Directives come back as :class:`Directive`,
    other rows as dicts or the dataclasses above.

    A backend sets :attr:`db` (a DB-API connection in autocommit mode whose rows read as
    mappings) and implements :meth:`tracker_key` and :meth:`lead`.
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
        #: the lease term this process leads under (the fencing token of its planning writes);
        #: None where it does not lead, or where only one tracker uses the database (ADR-0054)
        self.term: int | None = None

    def _sql(self, sql: str) -> str:
        """``sql`` with this backend's placeholder."""
        return sql if self.placeholder == "?" else _with_placeholder(sql, self.placeholder)

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

    def _insert_directives(self, rows: list[tuple]) -> list[dict]:
        """Insert directive ``rows`` (the columns of :data:`_INSERT_VALUES`, in order) inside the
        caller's transaction, :data:`INSERT_CHUNK` rows per statement, skipping each whose load or
        drop is open already; the rows inserted (``id`` and key)."""
        got: list[dict] = []
        for start in range(0, len(rows), INSERT_CHUNK):
            part = rows[start:start + INSERT_CHUNK]
            sql = _INSERT_VALUES.format(values=",".join(["(?,?,?,?,?,?,?,?,?,?)"] * len(part)))
            got += self.db.execute(sql, [value for row in part for value in row]).fetchall()
        return got

    def _append_directives(self, rows: list[tuple]) -> list[int]:
        """Insert directive ``rows`` as :meth:`_insert_directives` does, but none may be skipped, so
        each chunk's ids are the consecutive ones ending at its last row's (an ``AUTOINCREMENT``
        key drawn in the order of the values, inside the caller's transaction): no row is read
        back, which costs a third of the write at 7,000 directives (``bench/placement.py``).

        Raises:
            sqlite3.IntegrityError: one of them is open already (the caller undoes the chunks).
        """
        ids: list[int] = []
        for start in range(0, len(rows), INSERT_CHUNK):
            part = rows[start:start + INSERT_CHUNK]
            sql = _APPEND_VALUES.format(values=",".join(["(?,?,?,?,?,?,?,?,?,?)"] * len(part)))
            last = self.db.execute(sql, [value for row in part for value in row]).lastrowid
            ids.extend(range(last - len(part) + 1, last + 1))
        return ids

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
            self.db.execute("SAVEPOINT batch")
            try:
                ids = self._append_directives(rows)
            except sqlite3.IntegrityError:  # a load or drop open already: undone, inserted again skipping it
                self.db.execute("ROLLBACK TO batch")
            else:
                return ids
            finally:
                self.db.execute("RELEASE batch")
            return matched_ids(new, self._insert_directives(rows))

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

    def forget_nodes(self, node_ids: list[str], error: str, *, delete_records: bool,
                     term: int | None = None) -> int:
        """For nodes that dropped out together: fail every open directive of each with ``error``
        and, with ``delete_records``, delete their shared records; one transaction whatever their
        number (a rack or a region dropping out costs two statements per :data:`FORGET_CHUNK`
        nodes, not two transactions a node). Returns how many directives failed. ``term``: the
        leader's lease term, as for :meth:`add_directives`.

        Raises:
            LeaseLost: ``term`` is no longer this process's lease (nothing changed).
        """
        if not node_ids:
            return 0
        opened = ",".join("?" * len(OPEN_STATUSES))
        failed, now = 0, time.time()
        with self._transaction():
            self._check_term(term)
            for start in range(0, len(node_ids), FORGET_CHUNK):
                part = node_ids[start:start + FORGET_CHUNK]
                ids = ",".join("?" * len(part))
                failed += self._execute(f"UPDATE directives SET status = 'failed', error = ?, updated_at = ? "
                                        f"WHERE node_id IN ({ids}) AND status IN ({opened})",
                                        (error, now, *part, *OPEN_STATUSES)).rowcount
                if delete_records:
                    self._execute(f"DELETE FROM nodes WHERE node_id IN ({ids})", tuple(part))
        return failed

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

    def pins_of(self, node_ids: list[str]) -> dict[str, list[dict]]:
        """The pins of each of ``node_ids`` that has any, oldest first, in one statement."""
        if not node_ids:
            return {}
        found: dict[str, list[dict]] = {}
        marks = ",".join("?" * len(node_ids))
        for pin in self._rows(f"SELECT * FROM pins WHERE node_id IN ({marks}) ORDER BY created_at", tuple(node_ids)):
            found.setdefault(pin["node_id"], []).append(pin)
        return found

    def remove_pin(self, node_id: str, model: str) -> bool:
        """Delete the pin of ``model`` on ``node_id``; True when there was one."""
        return self._exec("DELETE FROM pins WHERE node_id = ? AND model = ?", (node_id, model)) > 0

    # node records, shared by the trackers of one database (ADR-0043)
    def _save_node(self, row: NodeRow) -> bool:
        return self._execute(
            "INSERT INTO nodes (node_id, record, record_at, heartbeat_at, sent_at) VALUES (?,?,?,?,?) "
            "ON CONFLICT (node_id) DO UPDATE SET record = excluded.record, record_at = excluded.record_at, "
            "heartbeat_at = excluded.heartbeat_at, sent_at = excluded.sent_at "
            "WHERE excluded.sent_at = 0 OR nodes.sent_at < excluded.sent_at "
            "OR (nodes.sent_at = excluded.sent_at AND nodes.record_at <= excluded.record_at)",
            (row.node_id, row.record, row.record_at, row.heartbeat_at, row.sent_at)).rowcount > 0

    def save_node(self, row: NodeRow) -> bool:
        """Write (insert or replace) one node's record, unless the stored one came from a later
        call of the node (``sent_at``, ADR-0054), or from the same call and was written later (a
        probe's verdict written after the registration it followed); returns whether it was written."""
        with self.lock:
            return self._save_node(row)

    def save_nodes(self, rows: list[NodeRow]) -> list[bool]:
        """:meth:`save_node` of each of ``rows``, in order, in one transaction (a group commit of
        the calls that arrived together, ADR-0063); returns whether each was written."""
        if not rows:
            return []
        with self._transaction():
            return [self._save_node(row) for row in rows]

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

