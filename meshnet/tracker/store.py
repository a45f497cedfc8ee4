"""Embedded tracker state in sqlite: pins, directives and models survive a tracker restart.

Nodes re-register on their own after a restart (their heartbeat gets 404), so live node
state is not stored; what only the tracker knows is: operator pins, the directive queue,
the models it keeps covered, and which public key owns each node id (ADR-0035). ``path=":memory:"`` keeps everything in memory (tests).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from meshnet.protocol.control import OPEN_STATUSES, Directive

__all__ = ["FINISHED_STATUSES", "OPEN_STATUSES", "NewDirective", "TrackerStore"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS directives (
  id INTEGER PRIMARY KEY AUTOINCREMENT, node_id TEXT NOT NULL, type TEXT NOT NULL,
  model TEXT, shard_start INTEGER, shard_end INTEGER, tier TEXT, status TEXT NOT NULL,
  error TEXT, reason TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS pins (
  node_id TEXT NOT NULL, model TEXT NOT NULL, shard_start INTEGER, shard_end INTEGER,
  created_at REAL NOT NULL, PRIMARY KEY (node_id, model));
CREATE TABLE IF NOT EXISTS models (name TEXT PRIMARY KEY, added_at REAL NOT NULL, source TEXT);
CREATE TABLE IF NOT EXISTS node_keys (node_id TEXT PRIMARY KEY, public_key TEXT NOT NULL, bound_at REAL NOT NULL);
-- what every heartbeat reads (a node's queued directives) and what rebalance and pruning read
-- (directives by status, finished ones by age); IF NOT EXISTS adds them to older databases (ADR-0037)
CREATE INDEX IF NOT EXISTS directives_by_node_status ON directives (node_id, status);
CREATE INDEX IF NOT EXISTS directives_by_status ON directives (status, updated_at);
"""

#: statuses of a finished directive, pruned after the retention period (ADR-0037)
FINISHED_STATUSES = ("done", "failed")

_INSERT_DIRECTIVE = ("INSERT INTO directives (node_id, type, model, shard_start, shard_end, tier, status, reason, "
                     "created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)")


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



class TrackerStore:
    """Thread-safe sqlite wrapper. Directives come back as :class:`Directive`, other rows as dicts.

    Every method takes :attr:`lock` for its whole statement or transaction, so a thread (the
    rebalance's batched write, the pruning) and the event loop never interleave inside one.
    """

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.lock = threading.Lock()
        with self.lock:
            self.db.executescript(SCHEMA)

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

    def _rows(self, sql: str, args: tuple = ()) -> list[dict]:
        with self.lock:
            return [dict(r) for r in self.db.execute(sql, args).fetchall()]

    def _exec(self, sql: str, args: tuple = ()) -> int:
        with self.lock:
            return self.db.execute(sql, args).lastrowid

    # directives
    def add_directive(self, node_id: str, type_: str, *, model: str | None = None, shard_start: int | None = None,
                      shard_end: int | None = None, tier: str | None = None, reason: str = "") -> Directive:
        now = time.time()
        rid = self._exec(_INSERT_DIRECTIVE, (node_id, type_, model, shard_start, shard_end, tier, "queued", reason,
                                             now, now))
        return self.directive(rid)

    def add_directives(self, new: list[NewDirective]) -> list[int]:
        """Queue many directives in one transaction (one commit, whatever their number); returns
        their ids in the order given. A failure rolls the whole batch back and re-raises
        (``sqlite3.Error``). Safe to call from a worker thread (rebalance does, ADR-0037)."""
        if not new:
            return []
        now = time.time()
        ids = []
        with self._transaction():
            for d in new:
                ids.append(self.db.execute(_INSERT_DIRECTIVE, (d.node_id, d.type, d.model, d.shard_start, d.shard_end,
                                                               d.tier, "queued", d.reason, now, now)).lastrowid)
        return ids

    def prune_finished(self, older_than_s: float, now: float | None = None) -> int:
        """Delete finished directives (:data:`FINISHED_STATUSES`) last updated more than
        ``older_than_s`` seconds ago (unix time ``now``, default the clock); open ones always stay.
        Returns how many rows were deleted."""
        cutoff = (time.time() if now is None else now) - older_than_s
        marks = ",".join("?" * len(FINISHED_STATUSES))
        with self.lock:
            return self.db.execute(f"DELETE FROM directives WHERE status IN ({marks}) AND updated_at < ?",
                                   (*FINISHED_STATUSES, cutoff)).rowcount

    def fail_open(self, node_id: str, error: str) -> int:
        """Mark every open directive of ``node_id`` failed with ``error`` in one statement; returns how many."""
        marks = ",".join("?" * len(OPEN_STATUSES))
        with self.lock:
            return self.db.execute(f"UPDATE directives SET status = 'failed', error = ?, updated_at = ? "
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

    def set_status(self, directive_id: int, status: str, error: str | None = None) -> None:
        self._exec("UPDATE directives SET status = ?, error = ?, updated_at = ? WHERE id = ?",
                   (status, error, time.time(), directive_id))

    def set_statuses(self, updates: list[tuple[int, str, str | None]], *, node_id: str) -> None:
        """Apply ``(directive id, status, error)`` updates to directives of ``node_id`` in one
        transaction (one commit): what a heartbeat reports and delivers (ADR-0037). An id of
        another node's directive, or an unknown one, changes nothing."""
        if not updates:
            return
        now = time.time()
        with self._transaction():
            self.db.executemany("UPDATE directives SET status = ?, error = ?, updated_at = ? WHERE id = ? AND node_id = ?",
                                [(status, error, now, i, node_id) for i, status, error in updates])

    # pins
    def add_pin(self, node_id: str, model: str, shard_start: int | None, shard_end: int | None) -> None:
        self._exec("INSERT OR REPLACE INTO pins VALUES (?,?,?,?,?)",
                   (node_id, model, shard_start, shard_end, time.time()))

    def pins(self, node_id: str | None = None) -> list[dict]:
        """Operator pins (all, or one node's), oldest first: ``{node_id, model, shard_start, shard_end}``."""
        if node_id is None:
            return self._rows("SELECT * FROM pins ORDER BY created_at")
        return self._rows("SELECT * FROM pins WHERE node_id = ? ORDER BY created_at", (node_id,))

    def remove_pin(self, node_id: str, model: str) -> bool:
        """Delete the pin of ``model`` on ``node_id``; True when there was one."""
        with self.lock:
            return self.db.execute("DELETE FROM pins WHERE node_id = ? AND model = ?", (node_id, model)).rowcount > 0

    # node keys (ADR-0035)
    def bind_key(self, node_id: str, public_key: str) -> str:
        """Bind ``node_id`` to ``public_key`` unless it is bound already; returns the key it is bound
        to now (the earlier one when there was one: first registration wins)."""
        with self.lock:
            self.db.execute("INSERT OR IGNORE INTO node_keys VALUES (?,?,?)", (node_id, public_key, time.time()))
            return self.db.execute("SELECT public_key FROM node_keys WHERE node_id = ?", (node_id,)).fetchone()[0]

    def node_key(self, node_id: str) -> str | None:
        """The public key bound to ``node_id`` (base64url), or None."""
        rows = self._rows("SELECT public_key FROM node_keys WHERE node_id = ?", (node_id,))
        return rows[0]["public_key"] if rows else None

    # models
    def add_model(self, name: str, source: str = "operator") -> None:
        self._exec("INSERT OR IGNORE INTO models VALUES (?,?,?)", (name, time.time(), source))

    def model_sources(self) -> dict[str, str]:
        """Model name → how it became tracked: ``operator`` (``--model``/pin) or ``demand``."""
        return {r["name"]: r["source"] for r in self._rows("SELECT name, source FROM models")}

    def models(self) -> list[str]:
        return [r["name"] for r in self._rows("SELECT name FROM models ORDER BY added_at")]
