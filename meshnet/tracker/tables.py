"""The tracker store's tables: the schema every backend creates (and how a batch of directives is
inserted and matched to its ids), and the small tables the trackers of one database share
(ADR-0035, ADR-0042, ADR-0043, ADR-0054).

:class:`SharedRecords` is the part of :class:`meshnet.tracker.store.TrackerStore` that keeps them:
which public key owns each node id, the tracked models, the quarantines, the known weights
digests, the demand events and the reported hop failures. Where two trackers may write the same
key at once the first writer wins (:meth:`SharedRecords._first_wins`): a restart or a second
tracker must neither lift a quarantine nor let another key or digest replace the first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
CREATE TABLE IF NOT EXISTS trusted_nodes (node_id TEXT PRIMARY KEY, since {real} NOT NULL);
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


#: directives per multi-row INSERT of :meth:`TrackerStore.add_directives`: ten bound values each,
#: within sqlite's default limit of 32,766 variables per statement
INSERT_CHUNK = 3000
_APPEND_VALUES = ("INSERT INTO directives (node_id, type, model, shard_start, shard_end, tier, status, reason, "
                  "created_at, updated_at) VALUES {values}")
_INSERT_VALUES = _APPEND_VALUES + " ON CONFLICT DO NOTHING RETURNING id, node_id, type, model, shard_start, shard_end"


def matched_ids(new: list, got: list) -> list[int | None]:
    """The id of each directive of ``new`` among the rows an insert returned (``id`` and key), None
    for one a conflict skipped. Ids are drawn in the order given, so the returned rows sorted by id
    match ``new`` in order, the skipped ones left out (none skipped: the ids sorted are the answer)."""
    if len(got) == len(new):
        return sorted(r["id"] for r in got)
    rows = sorted(got, key=lambda r: r["id"])
    out: list[int | None] = []
    k = 0
    for d in new:
        row = rows[k] if k < len(rows) else None
        if row is not None and (row["node_id"], row["type"], row["model"], row["shard_start"], row["shard_end"]) == \
                (d.node_id, d.type, d.model, d.shard_start, d.shard_end):
            out.append(row["id"])
            k += 1
        else:
            out.append(None)
    return out


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


class SharedRecords:
    """Node keys, tracked models, quarantines, weights digests, demand events and hop failures.

    A mixin of :class:`meshnet.tracker.store.TrackerStore`, which provides ``lock`` and the
    statement helpers ``_rows``, ``_exec`` and ``_execute`` (rows read as mappings).
    """

    def _first_wins(self, table: str, key: str, column: str, row: tuple) -> str:
        """Insert ``row`` (key first, ``column`` second) into ``table`` unless its key is there; returns
        ``column`` of the row in force (the earlier one when there was one), in one locked step."""
        with self.lock:
            return self._first_wins_locked(table, key, column, row)

    def _first_wins_locked(self, table: str, key: str, column: str, row: tuple) -> str:
        """:meth:`_first_wins` for a caller that holds the lock."""
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

    def bind_keys(self, pairs: list[tuple[str, str]]) -> list[str]:
        """:meth:`bind_key` of each ``(node_id, public_key)``, in order, in one transaction (a group
        commit of registrations arriving together, ADR-0063); returns the key each id is bound to
        now (of two pairs for one new id, the first binds it)."""
        if not pairs:
            return []
        now = time.time()
        with self._transaction():
            return [self._first_wins_locked("node_keys", "node_id", "public_key", (node_id, key, now))
                    for node_id, key in pairs]

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

    def anchor_digest(self, shard_key: str, digest: str) -> None:
        """Make ``digest`` the known digest of ``shard_key`` whatever was known: a node the operator
        trusts computed it (ADR-0069)."""
        self._exec("INSERT INTO digests VALUES (?,?,?) ON CONFLICT (shard_key) DO UPDATE SET digest = excluded.digest, "
                   "known_at = excluded.known_at", (shard_key, digest, time.time()))

    # nodes the operator trusts (ADR-0069)
    def trust_node(self, node_id: str, trusted: bool) -> bool:
        """Mark ``node_id`` trusted by the operator (or no longer); True when that changed anything."""
        if trusted:
            return self._exec("INSERT INTO trusted_nodes VALUES (?,?) ON CONFLICT DO NOTHING",
                              (node_id, time.time())) > 0
        return self._exec("DELETE FROM trusted_nodes WHERE node_id = ?", (node_id,)) > 0

    def trusted_nodes(self) -> set[str]:
        """The node ids the operator trusts."""
        return {r["node_id"] for r in self._rows("SELECT node_id FROM trusted_nodes")}

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
