"""Tracker state in PostgreSQL (``--db postgresql://...``), shared by several trackers (ADR-0043).

The statements are :class:`~meshnet.tracker.store.TrackerStore`'s; this backend adds the
connection (psycopg 3, autocommit, rows as dicts, a deadline on every statement and on the
network), the schema's column types, and leadership by lease (ADR-0054): one row of
``tracker_lease`` names the holder, its term and an expiry on the database's clock. The leader
renews it every control-loop round (a connection of its own); a tracker leads only while its
lease is valid by its own monotonic clock, counted from before the renewal was sent, so it stops
the moment it cannot renew, however long it was frozen. Every planning write carries the term
and checks it against the row, under a share lock, in its own transaction: a leader that wakes up
after its successor took over has its writes refused (:class:`LeaseLost`). The ticket key is one
row of ``tracker_meta``, made by the first tracker to start.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
import urllib.parse

import psycopg
import psycopg.errors
import psycopg.sql
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from psycopg.rows import dict_row

from meshnet.errors import MeshnetError
from meshnet.protocol.control import OPEN_STATUSES
from meshnet.tracker.store import LeaseLost, NewDirective, TrackerStore
from meshnet.tracker.tables import _FAIL_DUPLICATES, OPEN_ONCE, SCHEMA, matched_ids

log = logging.getLogger(__name__)

#: held while a tracker creates the schema, so two starting at once do not race on it
#: (an advisory lock key; advisory locks are per database)
SCHEMA_LOCK = 0x6D6573686E6575
#: seconds to wait for the server when connecting
CONNECT_TIMEOUT_S = 5
#: the longest any statement may run on the server, milliseconds (a big directive batch takes
#: well under a second; a lock wait or a stuck server ends in an error, never a hang)
STATEMENT_TIMEOUT_MS = 10_000
#: the network's own deadline: data unacknowledged this long, or an idle connection whose
#: keepalive probes go unanswered (2 s idle + 3 probes 1 s apart), breaks the connection, milliseconds
TCP_USER_TIMEOUT_MS = 5_000
#: how long a lease lasts from a renewal, seconds; the leader renews about every second (the
#: control loop), so a frozen or cut-off leader is replaced within this plus one round (ADR-0054)
LEASE_S = 4.0
#: the lease row: the holder (a tracker's origin id), its term (the fencing token: +1 at every
#: change of holder) and the expiry on the database's clock
LEASE_SCHEMA = """
CREATE TABLE IF NOT EXISTS tracker_lease (
  id INTEGER PRIMARY KEY CHECK (id = 1), holder TEXT NOT NULL, term BIGINT NOT NULL, expires_at TIMESTAMPTZ NOT NULL);
INSERT INTO tracker_lease VALUES (1, '', 0, '-infinity') ON CONFLICT DO NOTHING;
"""
#: take or renew the lease: kept by its holder, taken by anyone once expired (a new term)
_RENEW = """
UPDATE tracker_lease SET
  term = CASE WHEN holder = %(me)s AND expires_at > clock_timestamp() THEN term ELSE term + 1 END,
  holder = %(me)s, expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s)
WHERE id = 1 AND (holder = %(me)s OR expires_at <= clock_timestamp())
RETURNING term"""
#: the lease as a write of term %(term)s must find it (held under a share lock to the commit, so
#: the lease cannot change hands while the write is in flight)
_FENCE = ("SELECT holder, term, expires_at > clock_timestamp() AS valid FROM tracker_lease "
          "WHERE id = 1 FOR SHARE")
#: a batch of directives as one JSON array of rows (keys n, t, m, s, e, r, w: node, type, model,
#: first and last layer, tier, reason), inserted in their order (ids drawn in that order). One JSON
#: text, encoded by the json module's C encoder, costs the writing thread less than seven parameter
#: arrays, which psycopg dumps element by element in Python (the write of bench/placement.py's 7,081
#: directives alone, timed around add_directives: median 169 -> 138 ms over 6 runs each)
_INSERT_ROWS = """
INSERT INTO directives (node_id, type, model, shard_start, shard_end, tier, status, reason, created_at, updated_at)
SELECT n, t, m, s, e, r, 'queued', w, %s, %s
FROM ROWS FROM (json_to_recordset(%s::json) AS (n text, t text, m text, s int, e int, r text, w text))
     WITH ORDINALITY AS x(n, t, m, s, e, r, w, ord)
ORDER BY ord
ON CONFLICT DO NOTHING
RETURNING id, node_id, type, model, shard_start, shard_end"""

#: ``n`` directive ids drawn from the table's own identity sequence, for a batch written by COPY
#: (its name is looked up once, :attr:`PostgresStore._id_sequence`: a lookup per row made this 15 ms
#: for 7,081 ids here, against 2 ms)
_DRAW_IDS = "SELECT array_agg(nextval(%s::regclass)) AS ids FROM generate_series(1, %s)"
_COPY_ROWS = ("COPY directives (id, node_id, type, model, shard_start, shard_end, tier, status, reason, created_at, "
              "updated_at) FROM STDIN (FORMAT BINARY)")
#: the columns' types in :data:`_COPY_ROWS` (binary rows: psycopg formats them in C, a third of the text
#: format's time on the writing thread here: 3 ms against 11 ms for 7,081 rows)
_COPY_TYPES = ("int8", "text", "text", "text", "int4", "int4", "text", "text", "text", "float8", "float8")


#: libpq parameters of every connection: the deadlines above (ADR-0054)
DEADLINES = {"connect_timeout": CONNECT_TIMEOUT_S, "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
             "tcp_user_timeout": TCP_USER_TIMEOUT_MS, "keepalives": 1, "keepalives_idle": 2,
             "keepalives_interval": 1, "keepalives_count": 3}


def connect(url: str) -> psycopg.Connection:
    """An autocommit connection to ``url`` whose rows read as dicts, with :data:`DEADLINES`.

    Raises:
        MeshnetError (503 ``database_unreachable``): the server cannot be reached or refuses.
    """
    try:
        return psycopg.connect(url, autocommit=True, row_factory=dict_row, **DEADLINES)
    except psycopg.Error as exc:
        raise MeshnetError(f"cannot connect to the tracker database {redact(url)}: {exc}".strip(),
                           code="database_unreachable", status=503,
                           hint="is PostgreSQL running and does the database exist? "
                                "(--db postgresql://user@host:5432/dbname)") from exc


def redact(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://..."
    user = info.get("user", "")
    return f"postgresql://{user + '@' if user else ''}{info.get('host', '')}:{info.get('port', 5432)}/{info.get('dbname', '')}"


class PostgresStore(TrackerStore):
    """The tracker store in PostgreSQL at ``url``; several trackers may share it.

    Raises:
        MeshnetError (``database_unreachable``): the server cannot be reached.
    """

    shared = True
    IntegrityError = psycopg.IntegrityError
    database_errors = (psycopg.OperationalError,)
    placeholder = "%s"

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.db = connect(url)
        #: this process in the lease row (host, pid and a random suffix: readable in logs)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._lease_db: psycopg.Connection | None = None
        self._lease_lock = threading.Lock()
        self._lease_until = 0.0  # monotonic time the lease ends by this process's clock
        with self.lock, self.db.transaction():
            self.db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            self.db.execute(SCHEMA.format(id="BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
                                          real="DOUBLE PRECISION"))
            self.db.execute(LEASE_SCHEMA)
            self.db.execute("ALTER TABLE nodes ADD COLUMN IF NOT EXISTS sent_at DOUBLE PRECISION NOT NULL DEFAULT 0")
            self.db.execute(_FAIL_DUPLICATES)
            self.db.execute(OPEN_ONCE)
            self._id_sequence = self.db.execute("SELECT pg_get_serial_sequence('directives', 'id') AS s").fetchone()["s"]

    def _executemany(self, sql: str, rows: list[tuple]) -> None:
        with self.db.cursor() as cur:
            cur.executemany(self._sql(sql), rows)

    def add_directives(self, new: list[NewDirective], *, term: int | None = None) -> list[int | None]:
        """:meth:`TrackerStore.add_directives` by ``COPY`` (:meth:`_copy_directives`), fenced by ``term``
        when given. A batch one of whose loads or drops is open already (another tracker's or an
        operator's, which ``COPY`` cannot skip) is undone to a savepoint and inserted again row by
        row with the conflicting ones skipped (:data:`_INSERT_ROWS`): ids are drawn in the order
        given either way, and a skipped row's id is None."""
        if not new:
            return []
        now = time.time()
        with self._transaction():
            self._check_term(term)
            try:
                with self.db.transaction():  # a savepoint inside the batch's transaction
                    return self._copy_directives(new, now)
            except psycopg.errors.UniqueViolation:
                pass
            rows = json.dumps([{"n": d.node_id, "t": d.type, "m": d.model, "s": d.shard_start, "e": d.shard_end,
                                "r": d.tier, "w": d.reason} for d in new])
            got = self.db.execute(_INSERT_ROWS, (now, now, rows)).fetchall()
        return matched_ids(new, got)

    def _copy_directives(self, new: list[NewDirective], now: float) -> list[int]:
        """Queue ``new`` by one ``COPY`` with ids drawn beforehand (one statement), in the order
        given. ``COPY`` formats rows in psycopg's C code and the server inserts them while the
        rest is sent: 7,081 directives took 37 ms here (ids 3, the server's inserts most of the rest)
        against 65-74 ms for the JSON insert with ``ON CONFLICT ... RETURNING``.

        Raises:
            psycopg.errors.UniqueViolation: one of them is open already (nothing is kept).
        """
        ids = sorted(self.db.execute(_DRAW_IDS, (self._id_sequence, len(new))).fetchone()["ids"])
        with self.db.cursor().copy(_COPY_ROWS) as copy:
            copy.set_types(_COPY_TYPES)
            for i, d in zip(ids, new):
                copy.write_row((i, d.node_id, d.type, d.model, d.shard_start, d.shard_end, d.tier, "queued",
                                d.reason, now, now))
        return ids

    def forget_nodes(self, node_ids: list[str], error: str, *, delete_records: bool,
                     term: int | None = None) -> int:
        """:meth:`TrackerStore.forget_nodes` with the ids as one array parameter: a statement of each
        kind whatever their number (5,000 ids parsed as parameters took most of the time)."""
        if not node_ids:
            return 0
        with self._transaction():
            self._check_term(term)
            failed = self.db.execute("UPDATE directives SET status = 'failed', error = %s, updated_at = %s "
                                     "WHERE node_id = ANY(%s) AND status = ANY(%s)",
                                     (error, time.time(), list(node_ids), list(OPEN_STATUSES))).rowcount
            if delete_records:
                self.db.execute("DELETE FROM nodes WHERE node_id = ANY(%s)", (list(node_ids),))
        return failed

    def touch_nodes(self, heartbeats: dict[str, float]) -> None:
        """:meth:`TrackerStore.touch_nodes` as one statement over arrays."""
        if heartbeats:
            with self.lock:
                self.db.execute("UPDATE nodes SET heartbeat_at = v.at FROM unnest(%s::text[], %s::float8[]) "
                                "AS v(node_id, at) WHERE nodes.node_id = v.node_id AND nodes.heartbeat_at < v.at",
                                (list(heartbeats), list(heartbeats.values())))

    def _check_term(self, term: int | None) -> None:
        """Inside a transaction: refuse a write of ``term`` unless this process holds the lease of
        that term, unexpired on the database's clock; the row stays share-locked to the commit.

        Raises:
            LeaseLost: another tracker holds the lease now, or it expired.
        """
        if term is None:
            return
        row = self.db.execute(_FENCE).fetchone()
        if (row["holder"], row["term"], row["valid"]) != (self.holder, term, True):
            self._lose_lease()
            raise LeaseLost(f"write of lease term {term} refused: the lease is at term {row['term']}, held by "
                            f"{row['holder'] or 'nobody'}{'' if row['valid'] else ' (expired)'}")

    def lead(self) -> bool:
        """Take or renew the lease (ADR-0054); whether this process leads now. A renewal that
        fails or finds another holder ends leadership at once; one still waiting on the
        database from an earlier call answers False without waiting. Never raises."""
        if not self._lease_lock.acquire(blocking=False):
            return False  # the previous renewal is stuck on the database: not leading
        try:
            sent = time.monotonic()
            try:
                if self._lease_db is None:
                    self._lease_db = connect(self.url)
                row = self._lease_db.execute(_RENEW, {"me": self.holder, "lease_s": LEASE_S}).fetchone()
            except (psycopg.Error, MeshnetError) as exc:
                if self.term is not None:
                    log.warning("cannot renew the lease (term %d): %s; this tracker stops leading", self.term, exc)
                self._drop_lease_connection()
                self._lose_lease()
                return False
            if row is None:
                if self.term is not None:
                    log.warning("lost the lease (term %d) to another tracker; this tracker stops leading", self.term)
                self._lose_lease()
                return False
            if row["term"] != self.term:
                log.info("holds the lease now, term %d (%s)", row["term"], self.holder)
            self.term, self._lease_until = row["term"], sent + LEASE_S
            return True
        finally:
            self._lease_lock.release()

    def lease_valid(self) -> bool:
        """Whether this process's lease is still valid by its own monotonic clock (which runs
        on while the process is frozen, so a leader that wakes up late knows at once)."""
        return self.term is not None and time.monotonic() < self._lease_until

    def _lose_lease(self) -> None:
        self.term, self._lease_until = None, 0.0

    def _drop_lease_connection(self) -> None:
        conn, self._lease_db = self._lease_db, None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def resign(self) -> None:
        """Stop leading and end the lease now, so that a standby takes over at its next round."""
        with self._lease_lock:
            if self.term is not None and self._lease_db is not None:
                try:
                    self._lease_db.execute("UPDATE tracker_lease SET expires_at = '-infinity' WHERE id = 1 AND holder = %s",
                                           (self.holder,))
                except psycopg.Error as exc:
                    log.warning("could not end the lease on resigning: %s (it expires by itself)", exc)
            self._lose_lease()
            self._drop_lease_connection()

    def close(self) -> None:
        self.resign()
        self.db.close()

    def reconnect(self) -> None:
        """A new connection when the store's broke (the database was unreachable: a call on the
        broken one fails at once, so the event loop never waits on it more than one deadline).

        Raises:
            MeshnetError (``database_unreachable``): still unreachable.
        """
        if self.db.closed:
            fresh = connect(self.url)
            with self.lock:
                self.db = fresh
            log.warning("reconnected to the tracker database %s", redact(self.url))

    def tracker_key(self) -> Ed25519PrivateKey:
        """The ticket key in ``tracker_meta`` (raw 32 bytes, base64), made by whichever tracker
        starts first; every tracker of this database signs with it (ADR-0038, ADR-0043)."""
        fresh = base64.b64encode(Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())).decode()
        with self.lock:
            self.db.execute("INSERT INTO tracker_meta VALUES ('ticket_key', %s) ON CONFLICT DO NOTHING", (fresh,))
            stored = self.db.execute("SELECT value FROM tracker_meta WHERE name = 'ticket_key'").fetchone()["value"]
        return Ed25519PrivateKey.from_private_bytes(base64.b64decode(stored))


def create_database(server_url: str, name: str) -> str:
    """Create the empty database ``name`` on the server of ``server_url`` (any database on it
    that the user can reach); returns the URL of the new one (tests and benches: a fresh
    database per run, so parallel runs never meet).

    Raises:
        MeshnetError (``database_unreachable``): the server cannot be reached.
    """
    with connect(server_url) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    if server_url.startswith(("postgresql://", "postgres://")):
        return urllib.parse.urlsplit(server_url)._replace(path=f"/{name}").geturl()
    return psycopg.conninfo.make_conninfo(server_url, dbname=name)


def drop_database(server_url: str, name: str) -> None:
    """Drop database ``name`` (its open connections are ended first); no error when it is gone."""
    with connect(server_url) as conn:
        conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name)))


@contextlib.contextmanager
def scratch_database(server_url: str, prefix: str = "meshnet_scratch") -> Iterator[str]:
    """A fresh database on the server of ``server_url`` for the length of the block, dropped
    afterwards (tests and benches: parallel runs never meet); yields its URL.

    Raises:
        MeshnetError (``database_unreachable``): the server cannot be reached.
    """
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    url = create_database(server_url, name)
    try:
        yield url
    finally:
        drop_database(server_url, name)
