"""Which store a tracker opens for its ``--db`` (ADR-0043)."""

from __future__ import annotations

from meshnet.tracker.store import SqliteStore, TrackerStore

#: URL schemes of a PostgreSQL database
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(db: str) -> TrackerStore:
    """The store for ``--db``: a ``postgresql://`` (or ``postgres://``) URL opens
    :class:`~meshnet.tracker.pgstore.PostgresStore` (psycopg imported only then); anything else
    is a sqlite path (``:memory:`` for tests).

    Raises:
        MeshnetError (``database_unreachable``): the PostgreSQL server cannot be reached.
    """
    if db.startswith(POSTGRES_SCHEMES):
        from meshnet.tracker.pgstore import PostgresStore
        return PostgresStore(db)
    return SqliteStore(db)
