"""Hop stream messages (meshnet.dataplane.frames): layout, round trips, refusals, stream URLs."""

from __future__ import annotations

import struct

import pytest
import torch

from meshnet.node import wire
from meshnet.errors import InvalidRequest
from meshnet.dataplane.frames import FLAG_LAST_ONLY, FLAG_NO_RESULT, HEADER_BYTES, ChainError, ChainOpen, Kind, \
    NO_KEY, Message, bundle, new_chain_key, pack, same_key, stream_url, unbundle, unpack

CHAIN = "0123456789abcdef0123456789abcdef"


def test_the_header_is_32_bytes_in_the_documented_layout():
    key = "fe" * 8
    data = pack(Kind.STEP, CHAIN, key=key, position=300, hop_index=2, flags=FLAG_LAST_ONLY, body=b"frame")
    assert HEADER_BYTES == 32 and len(data) == 32 + 5
    assert data[:4] == bytes([2, 2, 2, 1])
    assert data[4:20] == bytes.fromhex(CHAIN)
    assert data[20:28] == bytes.fromhex(key)
    assert struct.unpack("<I", data[28:32]) == (300,)
    assert data[32:] == b"frame"


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips(kind):
    data = pack(kind, CHAIN, position=2**32 - 1, hop_index=255, flags=FLAG_LAST_ONLY | FLAG_NO_RESULT, body=b"xyz")
    assert unpack(data) == Message(kind, CHAIN, 2**32 - 1, 255, 3, b"xyz")
    assert unpack(data).last_only and unpack(data).no_result


def test_a_bfloat16_decode_step_fits_the_budget_of_two_bytes_per_hidden_unit_plus_64():
    hidden = 576  # SmolLM2-135M
    hidden_state = torch.randn(1, 1, hidden)
    raw = wire.encode(hidden_state, dtype="bfloat16", compress=False)
    data = pack(Kind.STEP, CHAIN, position=1000, hop_index=1, flags=FLAG_LAST_ONLY, body=raw)
    assert len(data) == 32 + 20 + 2 * hidden == 1204 <= 2 * hidden + 64
    packed = pack(Kind.STEP, CHAIN, body=wire.encode(hidden_state, dtype="bfloat16"))  # zstd only when it pays
    assert len(packed) <= len(data)


@pytest.mark.parametrize("chain_id", ["", "xyz", "0123", CHAIN + "00", None])
def test_a_chain_id_must_be_32_hex_characters(chain_id):
    with pytest.raises(InvalidRequest, match="chain id must be 32 hex characters"):
        pack(Kind.STEP, chain_id)


def test_the_chain_key_travels_in_every_message_and_is_compared_whole():
    key = new_chain_key()
    assert len(key) == 16 and key != new_chain_key()
    message = unpack(pack(Kind.RESULT, CHAIN, key=key, position=4, body=b"frame"))
    assert message.key == key and same_key(message, key)
    assert not same_key(message, key[:-1] + ("0" if key[-1] != "0" else "1"))
    assert unpack(pack(Kind.STEP, CHAIN)).key == NO_KEY
    for bad in ("secret", "ab" * 16, "zz" * 8, None):
        with pytest.raises(InvalidRequest, match="chain key must be 16 hex characters"):
            pack(Kind.STEP, CHAIN, key=bad)


@pytest.mark.parametrize("field, value", [("position", -1), ("position", 2**32), ("hop_index", 256), ("flags", -1)])
def test_fields_out_of_range_are_refused(field, value):
    with pytest.raises(InvalidRequest, match="out of range"):
        pack(Kind.STEP, CHAIN, **{field: value})


@pytest.mark.parametrize("data, message", [
    (b"\x02\x01", "shorter than its 32-byte header"),
    (bytes([9, 2, 0, 0]) + bytes(28), "unknown stream message kind 9"),
    (bytes([2, 7, 0, 0]) + bytes(28), "unsupported stream message version 7"),
    (bytes([2, 1, 0, 0]) + bytes(28), "unsupported stream message version 1"),  # no chain key: refused
])
def test_malformed_messages_are_refused_with_the_reason(data, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        unpack(data)
    assert info.value.code == "invalid_stream_message"


def open_body(**over) -> bytes:
    body = {"model": "m", "entry": "e", "entry_endpoint": "http://e:1",
            "hops": [{"node_id": "a", "endpoint": "http://a:1", "start_layer": 2, "end_layer": 3}], "tickets": [None]}
    body.update(over)
    return ChainOpen.model_validate(body).to_body() if "bad" not in over else b"{}"


def test_open_round_trips_and_checks_one_ticket_per_hop():
    opened = ChainOpen.from_body(open_body())
    assert opened.hops[0].end_layer == 3 and opened.tickets == [None]
    with pytest.raises(InvalidRequest, match="2 tickets for 1 hops"):
        ChainOpen.from_body(open_body(tickets=["t", "u"]))
    with pytest.raises(InvalidRequest, match="bad chain OPEN: entry: Field required"):
        ChainOpen.from_body(b'{"entry_endpoint": "x", "hops": [], "tickets": []}')


def test_error_round_trips():
    err = ChainError(node_id="c", code="hop_unreachable", message="gone", status=502)
    assert ChainError.from_body(err.to_body()) == err
    with pytest.raises(InvalidRequest, match="bad chain ERROR: node_id"):
        ChainError.from_body(b'{"code": "x", "message": "y"}')


@pytest.mark.parametrize("endpoint, url", [
    ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/v1/stream"),
    ("https://node.example", "wss://node.example/v1/stream"),
    ("http://relay:9000/v1/relay/node-1", "ws://relay:9000/v1/relay/node-1/v1/stream"),
    ("http://relay:9000/v1/relay/node-1/", "ws://relay:9000/v1/relay/node-1/v1/stream"),
    ("HTTP://[::1]:81", "ws://[::1]:81/v1/stream"),
])
def test_stream_urls_keep_the_endpoint_path(endpoint, url):
    assert stream_url(endpoint) == url


def test_a_non_http_endpoint_has_no_stream_url():
    with pytest.raises(InvalidRequest, match="not an http:// or https:// URL"):
        stream_url("ftp://x")


def test_a_bundle_carries_its_messages_in_order_for_4_bytes_each_plus_a_header():
    steps = [pack(Kind.STEP, CHAIN, position=p, hop_index=1, body=bytes(range(p % 7))) for p in (5, 9, 40)]
    data = bundle(steps)
    assert len(data) == 32 + sum(4 + len(step) for step in steps)
    message = unpack(data)
    assert (message.kind, message.chain_id, message.position) == (Kind.BUNDLE, "0" * 32, 3)
    assert unbundle(message) == steps
    assert [unpack(inner).position for inner in unbundle(message)] == [5, 9, 40]


def test_eight_bfloat16_decode_steps_in_a_bundle_stay_within_two_bytes_per_hidden_unit_plus_64_each():
    hidden = 576  # SmolLM2-135M
    step = pack(Kind.STEP, CHAIN, position=1000, hop_index=1, flags=FLAG_LAST_ONLY,
                body=wire.encode(torch.randn(1, 1, hidden), dtype="bfloat16", compress=False))
    assert len(bundle([step] * 8)) / 8 == 1204 + 4 + 4 <= 2 * hidden + 64


def bundle_of(body: bytes, count: int) -> Message:
    return unpack(pack(Kind.BUNDLE, "0" * 32, position=count, body=body))


@pytest.mark.parametrize("body, count, reason", [
    (b"\x05\x00", 1, "ends inside a length at byte 0"),
    (struct.pack("<I", 30) + bytes(10), 1, "of 30 bytes runs past the bundle's end"),
    (struct.pack("<I", 2) + b"ab", 2, "header counts 2 messages, its body holds 1"),
    (struct.pack("<I", 32) + bytes([5, 2]) + bytes(30), 1, "bundled message 0 is itself a bundle"),
])
def test_a_malformed_bundle_is_refused_with_the_reason(body, count, reason):
    with pytest.raises(InvalidRequest, match=reason) as info:
        unbundle(bundle_of(body, count))
    assert info.value.code == "invalid_stream_message"


def test_an_empty_bundle_is_not_built():
    with pytest.raises(InvalidRequest, match="at least one message"):
        bundle([])
