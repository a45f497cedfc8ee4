"""Session tickets (ADR-0038): the tracker's signed word that a session may use a route.

The tracker signs, for one session, the route it hands an entry node: the session id, the
model, the entry node (id and public key), the hops (node id and inclusive layer range each),
when it was issued and when it expires. The entry sends the ticket with every hop call
(``X-Meshnet-Ticket``); a node that knows the tracker's key runs a hop only for a ticket that
names it for exactly those layers of that session, and releases a session only on a call
signed by the entry the ticket names.

Form: ``base64url(claims JSON) "." base64url(Ed25519 signature)``; the signature is over a
context line and the claims bytes exactly as sent, so the claims are never re-serialised
before checking. Torch-free and service-free: the tracker issues, nodes verify.
"""

from __future__ import annotations

import binascii
import json
import time

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import Field, ValidationError

from meshnet.errors import Forbidden, TicketExpired, Unauthorized
from meshnet.layers import LayerRange
from meshnet.protocol.control import MAX_TICKET_CHARS, Payload
from meshnet.protocol.route import Hop
from meshnet.protocol.signing import b64url, unb64url

__all__ = ["HEADER_TICKET", "MAX_TICKET_CHARS", "TICKET_TTL_S", "TicketClaims", "TicketHop", "check_hop",
           "issue_ticket", "read_ticket"]

#: the header that carries a session's ticket on hop calls and releases
HEADER_TICKET = "X-Meshnet-Ticket"
#: how long a ticket is valid, seconds (an entry asks again for a longer session)
TICKET_TTL_S = 600.0
#: domain separation: a ticket signature is never valid as a request signature, and vice versa
_CONTEXT = b"meshnet-ticket/1\n"


class TicketHop(Payload):
    """One hop a ticket names: the node and the layers it runs (inclusive, ADR-0002)."""

    node_id: str = Field(min_length=1)
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=0)


class TicketClaims(Payload):
    """What a ticket says. Times are unix seconds on the tracker's clock."""

    session: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1)
    entry: str = Field(min_length=1)
    entry_key: str = Field(pattern=r"^[A-Za-z0-9_-]{43}$")
    hops: list[TicketHop]
    issued_at: float
    expires_at: float

    @classmethod
    def for_route(cls, *, session: str, model: str, entry: str, entry_key: str, hops: list[Hop],
                  now: float | None = None, ttl_s: float = TICKET_TTL_S) -> "TicketClaims":
        """Claims for ``hops`` of one session, valid ``ttl_s`` seconds from ``now`` (unix seconds)."""
        now = time.time() if now is None else now
        named = [TicketHop(node_id=h.node_id, start_layer=h.layers.start, end_layer=h.layers.end - 1) for h in hops]
        return cls(session=session, model=model, entry=entry, entry_key=entry_key, hops=named,
                   issued_at=now, expires_at=now + ttl_s)


def issue_ticket(key: Ed25519PrivateKey, claims: TicketClaims) -> str:
    """Sign ``claims`` with the tracker's ``key``: the ticket as it travels (ASCII, no padding)."""
    body = json.dumps(claims.model_dump(mode="json"), separators=(",", ":"), sort_keys=True).encode()
    return f"{b64url(body)}.{b64url(key.sign(_CONTEXT + body))}"


def read_ticket(token: str | None, tracker_key: Ed25519PublicKey, *, now: float | None = None) -> TicketClaims:
    """Verify a ticket against the tracker's public key and return its claims.

    Args:
        token: the ``X-Meshnet-Ticket`` value (None or "": missing).
        now: unix seconds (default: the clock).

    Raises:
        Unauthorized (401): ``ticket_missing``; ``ticket_invalid`` (malformed, too long, or the
            signature does not verify: another key or changed claims); ``ticket_expired``.
    """
    if not token:
        raise Unauthorized("this node runs hops only with a session ticket from its tracker", code="ticket_missing",
                           hint=f"the entry node sends the route's ticket in {HEADER_TICKET} (ADR-0038)")
    try:
        if len(token) > MAX_TICKET_CHARS:
            raise ValueError(f"{len(token)} characters")
        body_text, signature_text = token.split(".")
        body, signature = unb64url(body_text), unb64url(signature_text)
        tracker_key.verify(signature, _CONTEXT + body)
        claims = TicketClaims.model_validate_json(body)
    except (ValueError, binascii.Error, InvalidSignature, ValidationError) as exc:
        why = "signature does not verify" if isinstance(exc, InvalidSignature) else type(exc).__name__
        raise Unauthorized(f"session ticket is not valid ({why})", code="ticket_invalid",
                           hint="a ticket must come from this node's tracker, unchanged") from None
    return check_unexpired(claims, now)


def check_unexpired(claims: "TicketClaims", now: float | None = None) -> "TicketClaims":
    """``claims`` when their ticket has not expired at ``now`` (unix seconds, default the clock).

    Raises:
        Unauthorized (401 ``ticket_expired``).
    """
    now = time.time() if now is None else now
    if now >= claims.expires_at:
        raise TicketExpired(f"session ticket of {claims.session} expired {now - claims.expires_at:.0f} s ago",
                            hint="the entry asks the tracker for a new route and ticket")
    return claims


class VerifiedTickets:
    """Tickets whose signature a node has already checked, so a session's every hop call costs a
    dict lookup and an expiry comparison, not an Ed25519 verification and a JSON parse.

    Keyed by the ticket string (a changed byte is another key, verified afresh); at most
    ``max_entries`` kept, oldest dropped first. Expiry is still checked on every call.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._claims: dict[str, TicketClaims] = {}
        self._key = None

    def read(self, token: str | None, tracker_key) -> "TicketClaims":
        """Like :func:`read_ticket` (a new tracker key forgets every ticket verified with the old one).

        Raises:
            Unauthorized (401): as :func:`read_ticket`.
        """
        if tracker_key is not self._key:
            self._claims.clear()
            self._key = tracker_key
        claims = self._claims.get(token) if token else None
        if claims is not None:
            return check_unexpired(claims)
        claims = read_ticket(token, tracker_key)
        if len(self._claims) >= self.max_entries:
            self._claims.pop(next(iter(self._claims)))
        self._claims[token] = claims
        return claims


def check_hop(claims: TicketClaims, *, node_id: str, session: str, layers: LayerRange,
              model: str | None = None) -> None:
    """Check that a verified ticket covers this hop call: ``session``, ``model`` (when given, as
    canonical names) and ``node_id`` running exactly ``layers`` (half-open).

    Raises:
        Forbidden (403 ``ticket_scope``): the ticket is for another session or model, or does not
            name this node for exactly these layers.
    """
    if claims.session != session:
        raise Forbidden(f"the ticket is for session {claims.session}, not {session}", code="ticket_scope")
    if model is not None and claims.model != model:
        raise Forbidden(f"the ticket is for model {claims.model}, not {model}", code="ticket_scope")
    start, end = layers.to_inclusive()
    if not any(h.node_id == node_id and (h.start_layer, h.end_layer) == (start, end) for h in claims.hops):
        raise Forbidden(f"the ticket of session {session} does not name {node_id} for layers {start}-{end}",
                        code="ticket_scope")
