"""Session tickets (ADR-0038): issue and verify, table-driven over what can be wrong."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.errors import Forbidden, Unauthorized
from meshnet.layers import LayerRange
from meshnet.protocol.route import Hop
from meshnet.protocol.signing import b64url, unb64url
from meshnet.protocol.tickets import TicketClaims, check_hop, issue_ticket, read_ticket
from meshnet.tracker.tickets import TicketIssuer, load_tracker_key
from tests.payloads import node_key, public_key

NOW = 1_700_000_000.0
TRACKER = node_key("tracker")
HOPS = [Hop("b", "http://b", LayerRange(2, 4)), Hop("c", "http://c", LayerRange(4, 6))]


def claims(**changes) -> TicketClaims:
    fields = dict(session="s1", model="tiny-llama", entry="a", entry_key=public_key("a"), hops=HOPS, now=NOW,
                  ttl_s=600.0)
    return TicketClaims.for_route(**{**fields, **changes})


def tamper(ticket: str, **changes) -> str:
    body, signature = ticket.split(".")
    data = {**json.loads(unb64url(body)), **changes}
    return f"{b64url(json.dumps(data).encode())}.{signature}"


def test_a_ticket_reads_back_its_claims_with_inclusive_layers():
    got = read_ticket(issue_ticket(TRACKER, claims()), TRACKER.public_key(), now=NOW + 1)
    assert got == claims()
    assert [(h.node_id, h.start_layer, h.end_layer) for h in got.hops] == [("b", 2, 3), ("c", 4, 5)]
    assert got.expires_at == NOW + 600.0 and got.entry == "a"


@pytest.mark.parametrize("token, key, now, code", [
    (None, TRACKER, NOW, "ticket_missing"),
    ("", TRACKER, NOW, "ticket_missing"),
    ("not-a-ticket", TRACKER, NOW, "ticket_invalid"),
    ("a.b.c", TRACKER, NOW, "ticket_invalid"),
    ("x" * 9000, TRACKER, NOW, "ticket_invalid"),
    (issue_ticket(TRACKER, claims()), TRACKER, NOW + 600.0, "ticket_expired"),
    (issue_ticket(TRACKER, claims()), node_key("tracker", salt="other"), NOW, "ticket_invalid"),  # wrong key
    (issue_ticket(node_key("impostor"), claims()), TRACKER, NOW, "ticket_invalid"),  # signed by someone else
    (tamper(issue_ticket(TRACKER, claims()), session="s2"), TRACKER, NOW, "ticket_invalid"),
    (tamper(issue_ticket(TRACKER, claims()), expires_at=NOW + 10**6), TRACKER, NOW + 700, "ticket_invalid"),
    (tamper(issue_ticket(TRACKER, claims()), hops=[{"node_id": "evil", "start_layer": 2, "end_layer": 5}]),
     TRACKER, NOW, "ticket_invalid"),
])
def test_a_bad_ticket_is_401(token, key, now, code):
    with pytest.raises(Unauthorized) as info:
        read_ticket(token, key.public_key(), now=now)
    assert info.value.status == 401 and info.value.code == code


@pytest.mark.parametrize("node, session, layers, model, ok", [
    ("b", "s1", LayerRange(2, 4), "tiny-llama", True),
    ("c", "s1", LayerRange(4, 6), None, True),
    ("b", "s1", LayerRange(2, 3), "tiny-llama", False),   # a part of its layers: not what it was named for
    ("b", "s1", LayerRange(2, 6), "tiny-llama", False),   # more than its layers
    ("c", "s1", LayerRange(2, 4), "tiny-llama", False),   # another hop's layers
    ("d", "s1", LayerRange(2, 4), "tiny-llama", False),   # a node the ticket does not name
    ("b", "s2", LayerRange(2, 4), "tiny-llama", False),   # another session
    ("b", "s1", LayerRange(2, 4), "tiny-gpt2", False),    # another model
])
def test_a_ticket_covers_only_its_hops_of_its_session(node, session, layers, model, ok):
    verified = read_ticket(issue_ticket(TRACKER, claims()), TRACKER.public_key(), now=NOW)
    if ok:
        check_hop(verified, node_id=node, session=session, layers=layers, model=model)
        return
    with pytest.raises(Forbidden) as info:
        check_hop(verified, node_id=node, session=session, layers=layers, model=model)
    assert info.value.status == 403 and info.value.code == "ticket_scope"


def test_a_session_belongs_to_the_entry_that_asked_first_while_its_ticket_lives():
    issuer = TicketIssuer(TRACKER, ttl_s=600.0)
    first = issuer.issue(session="s1", model="m", entry="a", entry_key=public_key("a"), hops=HOPS, now=NOW)
    again = issuer.issue(session="s1", model="m", entry="a", entry_key=public_key("a"), hops=HOPS[:1], now=NOW + 5)
    assert read_ticket(again, TRACKER.public_key(), now=NOW + 6).hops[0].node_id == "b" and first != again
    with pytest.raises(Forbidden) as info:
        issuer.issue(session="s1", model="m", entry="x", entry_key=public_key("x"), hops=HOPS, now=NOW + 10)
    assert info.value.code == "session_taken"
    later = issuer.issue(session="s1", model="m", entry="x", entry_key=public_key("x"), hops=HOPS, now=NOW + 606)
    assert read_ticket(later, TRACKER.public_key(), now=NOW + 607).entry == "x"  # the old one expired


def test_the_tracker_key_is_made_once_next_to_its_store(tmp_path):
    db = tmp_path / "state" / "tracker.db"
    key = load_tracker_key(str(db))
    path = tmp_path / "state" / "tracker.key"
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_tracker_key(str(db)).public_key().public_bytes_raw() == key.public_key().public_bytes_raw()
    assert isinstance(load_tracker_key(":memory:"), Ed25519PrivateKey)
