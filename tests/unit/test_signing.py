"""Signed node calls (meshnet.protocol.signing), the tracker's checks of them (meshnet.tracker.auth),
the node's key file (meshnet.node.identity) and who may report a hop failure."""

from __future__ import annotations

import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.errors import Forbidden, MeshnetError, NotFound, Unauthorized
from meshnet.node.identity import load_or_create_key
from meshnet.protocol.signing import (HEADER_NODE, HEADER_SIGNATURE, HEADER_TIMESTAMP, decode_public_key,
                                      encode_public_key, sign_request, verify_request)
from meshnet.tracker.auth import NodeAuth, exposure_problem, is_loopback
from meshnet.tracker.registry import NodeRecord, ShardRecord
from meshnet.layers import LayerRange
from meshnet.tracker.trust import may_report_failure

NOW = 1_800_000_000.0
PATH = "/v1/nodes/n1/heartbeat"
BODY = b'{"shards": [], "stats": {"sessions": 1}}'
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))


def headers(key=KEY, node_id="n1", method="POST", path=PATH, body=BODY, now=NOW, nonce="nonce-1") -> dict:
    return sign_request(key, node_id, method, path, body, now=now, nonce=nonce)


def verify(h: dict, *, method="POST", path=PATH, body=BODY, now=NOW, key=KEY):
    return verify_request(key.public_key(), h, method, path, body, now=now)


def test_a_good_signature_verifies_and_names_its_signer():
    call = verify(headers())
    assert (call.node_id, call.timestamp, call.nonce) == ("n1", NOW, "nonce-1")
    assert headers()[HEADER_TIMESTAMP] == "1800000000.000"


@pytest.mark.parametrize("change, code", [
    ({"body": b'{"shards": [], "stats": {"sessions": 9}}'}, "bad_signature"),   # tampered body
    ({"path": "/v1/nodes/n2/heartbeat"}, "bad_signature"),                       # moved to another node's path
    ({"method": "DELETE"}, "bad_signature"),                                     # another verb
    ({"key": OTHER}, "bad_signature"),                                           # checked against another key
    ({"now": NOW + 61}, "stale_signature"),                                      # 61 s later: stale
    ({"now": NOW - 61}, "stale_signature"),                                      # a clock 61 s behind
])
def test_anything_changed_or_stale_is_refused(change, code):
    with pytest.raises(Unauthorized) as exc:
        verify(headers(), **change)
    assert exc.value.status == 401 and exc.value.code == code


def test_within_the_skew_window_is_accepted():
    assert verify(headers(), now=NOW + 59).node_id == "n1"


def test_signed_by_another_key_or_with_a_renamed_signer_is_refused():
    with pytest.raises(Unauthorized):
        verify(headers(key=OTHER))
    renamed = {**headers(), HEADER_NODE: "n2"}  # the signer's id is part of what is signed
    with pytest.raises(Unauthorized):
        verify(renamed)


@pytest.mark.parametrize("drop", [HEADER_NODE, HEADER_SIGNATURE])
def test_an_unsigned_call_is_401(drop):
    h = headers()
    del h[drop]
    with pytest.raises(Unauthorized) as exc:
        verify(h)
    assert exc.value.code == "unsigned"


def test_public_keys_round_trip_and_garbage_is_a_422():
    text = encode_public_key(KEY.public_key())
    assert len(text) == 43 and encode_public_key(decode_public_key(text)) == text
    with pytest.raises(MeshnetError) as exc:
        decode_public_key("A" * 40)
    assert exc.value.status == 422


# ---- the tracker's side: replays, unknown signers, acting for another node ------------------


def test_a_replayed_call_is_refused_once_seen():
    auth = NodeAuth()
    public = encode_public_key(KEY.public_key())
    h = headers()
    assert auth.verify_node_call(public, h, "POST", PATH, BODY, as_node="n1", now=NOW) == "n1"
    with pytest.raises(Unauthorized) as exc:
        auth.verify_node_call(public, h, "POST", PATH, BODY, as_node="n1", now=NOW + 1)
    assert exc.value.code == "replayed"
    # a fresh nonce is a fresh call
    assert auth.verify_node_call(public, headers(nonce="nonce-2"), "POST", PATH, BODY, as_node="n1", now=NOW + 1)


def test_an_unknown_node_is_404_for_its_own_calls_and_an_unknown_signer_is_401():
    auth = NodeAuth()
    with pytest.raises(NotFound):  # the node registers again on this answer
        auth.verify_node_call(None, headers(), "POST", PATH, BODY, as_node="n1", now=NOW)
    with pytest.raises(Unauthorized):
        auth.verify_node_call(None, headers(), "POST", "/v1/nodes/n2/failure", BODY, now=NOW)


def test_a_node_may_not_act_for_another():
    with pytest.raises(Forbidden):
        NodeAuth().verify_node_call(encode_public_key(KEY.public_key()), headers(), "POST", PATH, BODY,
                                    as_node="n2", now=NOW)


def test_the_join_token_is_compared_when_set():
    NodeAuth().check_join_token({})  # none set: anyone may join
    auth = NodeAuth(join_token="s3cret")
    auth.check_join_token({"X-Meshnet-Join-Token": "s3cret"})
    for given in ({}, {"X-Meshnet-Join-Token": "guess"}):
        with pytest.raises(Unauthorized) as exc:
            auth.check_join_token(given)
        assert exc.value.code == "join_token"


# ---- exposure --------------------------------------------------------------------------------


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.5.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.20", False), ("tracker.example", False),
])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host, join, operator, insecure, refused", [
    ("127.0.0.1", None, None, False, False),     # loopback: both optional
    ("0.0.0.0", None, None, False, True),
    ("0.0.0.0", "j", None, False, True),
    ("0.0.0.0", None, "o", False, True),
    ("0.0.0.0", "j", "o", False, False),
    ("0.0.0.0", None, None, True, False),        # open on purpose
])
def test_a_tracker_beyond_loopback_needs_both_tokens(host, join, operator, insecure, refused):
    problem = exposure_problem(host, join, operator, insecure)
    assert bool(problem) is refused
    if refused:
        assert "--insecure" in problem and host in problem


# ---- who may report a hop failure --------------------------------------------------------------


def record(node_id: str, *shards: tuple[str, int, int]) -> NodeRecord:
    return NodeRecord(node_id, f"http://{node_id}", "", 1, 1, "cpu", ["bfloat16"], 0.0, None, 1, True,
                      shards=[ShardRecord(m, LayerRange(a, b), "pinned", "bfloat16", a == 0, 0, None)
                              for m, a, b in shards])


@pytest.mark.parametrize("sender, allowed", [
    (record("entry", ("m", 0, 2)), True),          # an entry of the model: it routes through the reported node
    (None, False),                                  # not a registered node
    (record("tail", ("m", 2, 4)), False),          # no entry shard: it drives no routes
    (record("other", ("x", 0, 4)), False),         # an entry of another model
    (record("hop", ("m", 2, 4)), False),
])
def test_who_may_report_a_failure(sender, allowed):
    reported = record("hop", ("m", 2, 4))
    assert (may_report_failure(sender, reported) == "") is allowed


# ---- the node's key file ---------------------------------------------------------------------


def test_a_node_makes_its_key_once_and_keeps_it_private(tmp_path):
    state = tmp_path / "nodes" / "n1"
    key = load_or_create_key(state)
    path = state / "node.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_key(state)
    assert encode_public_key(again.public_key()) == encode_public_key(key.public_key())
    assert list(state.iterdir()) == [path]  # no temporary file left


def test_a_key_file_that_is_not_a_key_is_a_clear_error(tmp_path):
    (tmp_path / "node.key").write_text("not a key")
    with pytest.raises(MeshnetError) as exc:
        load_or_create_key(tmp_path)
    assert exc.value.code == "node_key" and "node.key" in exc.value.message
