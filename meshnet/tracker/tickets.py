"""The tracker issues session tickets (ADR-0038).

The tracker's Ed25519 key signs them. With sqlite it lives next to the store
(``<db dir>/tracker.key``, made on first start, mode 0600), so nodes that learned the key at
registration keep accepting tickets across a tracker restart; a tracker with an in-memory store
(tests) makes a key for its lifetime only. With PostgreSQL it lives in the database, the same for
every tracker of it (:meth:`meshnet.tracker.pgstore.PostgresStore.tracker_key`, ADR-0043).

A session belongs to the first entry node that asks for a ticket for it, for as long as its
latest ticket is valid: another node cannot get a ticket for that session id, and so cannot
release it or run hops in it (:meth:`TicketIssuer.issue`).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet import keyfile
from meshnet.errors import Forbidden
from meshnet.protocol.route import Hop
from meshnet.protocol.signing import TRACKER_SIGNER, encode_public_key, sign_request
from meshnet.protocol.tickets import TICKET_TTL_S, TicketClaims, issue_ticket

KEY_FILE = "tracker.key"


def load_tracker_key(db_path: str) -> Ed25519PrivateKey:
    """The tracker's ticket key: ``<directory of db_path>/tracker.key``, made when there is none;
    a fresh key for this process when ``db_path`` is ``:memory:``.

    Raises:
        MeshnetError (``tracker_key``): the key file cannot be made or read.
    """
    if db_path == ":memory:" or not db_path:
        return Ed25519PrivateKey.generate()
    return keyfile.load_or_create_key(Path(db_path).parent / KEY_FILE, code="tracker_key",
                                      hint="the tracker keeps its key next to its --db (mode 0600)")


class TicketIssuer:
    """Signs session tickets and remembers which entry owns each live session.

    Args:
        key: the tracker's private key.
        ttl_s: how long a ticket is valid, seconds.
    """

    def __init__(self, key: Ed25519PrivateKey, ttl_s: float = TICKET_TTL_S) -> None:
        self.key, self.ttl_s = key, ttl_s
        self.public_key = encode_public_key(key.public_key())
        self._owners: dict[str, tuple[str, float]] = {}  # session -> (entry node id, owned until, unix s)
        self._pruned_at = 0.0

    def issue(self, *, session: str, model: str, entry: str, entry_key: str, hops: list[Hop],
              now: float | None = None) -> str:
        """A ticket naming ``hops`` of ``model`` for ``session``, driven by node ``entry`` (whose
        public key is ``entry_key``), valid ``ttl_s`` seconds from ``now`` (unix seconds).

        Raises:
            Forbidden (403 ``session_taken``): another entry holds a valid ticket for this session.
        """
        now = time.time() if now is None else now
        if now - self._pruned_at >= 60.0:
            self._owners = {s: o for s, o in self._owners.items() if o[1] > now}
            self._pruned_at = now
        owner = self._owners.get(session)
        if owner is not None and owner[0] != entry and owner[1] > now:
            raise Forbidden(f"session {session} belongs to another entry node", code="session_taken",
                            hint="an entry node chooses a fresh random session id per generation")
        claims = TicketClaims.for_route(session=session, model=model, entry=entry, entry_key=entry_key, hops=hops,
                                        now=now, ttl_s=self.ttl_s)
        self._owners[session] = (entry, claims.expires_at)
        return issue_ticket(self.key, claims)

    def sign_call(self, method: str, url: str) -> dict[str, str]:
        """Headers that sign a bodiless call to ``url`` (its path is what is signed) as the tracker,
        with the key nodes check tickets with: what a node shows or does only for its tracker
        (``GET /v1/traffic``'s session ids, ``POST /v1/doctor``; ADR-0049, ADR-0056)."""
        return sign_request(self.key, TRACKER_SIGNER, method, httpx.URL(url).path, b"")
