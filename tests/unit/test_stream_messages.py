"""Hop stream messages (meshnet.protocol.stream): layout, round trips, refusals, stream URLs."""

from __future__ import annotations

import struct

import pytest
import torch

from meshnet import wire
from meshnet.errors import InvalidRequest
from meshnet.protocol.stream import FLAG_LAST_ONLY, FLAG_NO_RESULT, HEADER_BYTES, ChainError, ChainOpen, Kind, \
    Message, pack, stream_url, unpack

CHAIN = "0123456789abcdef0123456789abcdef"


def test_the_header_is_24_bytes_in_the_documented_layout():
    data = pack(Kind.STEP, CHAIN, position=300, hop_index=2, flags=FLAG_LAST_ONLY, body=b"frame")
    assert HEADER_BYTES == 24 and len(data) == 24 + 5
    assert data[:4] == bytes([2, 1, 2, 1])
    assert data[4:20] == bytes.fromhex(CHAIN)
    assert struct.unpack("<I", data[20:24]) == (300,)
    assert data[24:] == b"frame"


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
    assert len(data) == 24 + 20 + 2 * hidden == 1196 <= 2 * hidden + 64
    packed = pack(Kind.STEP, CHAIN, body=wire.encode(hidden_state, dtype="bfloat16"))  # zstd only when it pays
    assert len(packed) <= len(data)


@pytest.mark.parametrize("chain_id", ["", "xyz", "0123", CHAIN + "00", None])
def test_a_chain_id_must_be_32_hex_characters(chain_id):
    with pytest.raises(InvalidRequest, match="chain id must be 32 hex characters"):
        pack(Kind.STEP, chain_id)


@pytest.mark.parametrize("field, value", [("position", -1), ("position", 2**32), ("hop_index", 256), ("flags", -1)])
def test_fields_out_of_range_are_refused(field, value):
    with pytest.raises(InvalidRequest, match="out of range"):
        pack(Kind.STEP, CHAIN, **{field: value})


@pytest.mark.parametrize("data, message", [
    (b"\x02\x01", "shorter than its 24-byte header"),
    (bytes([9, 1, 0, 0]) + bytes(20), "unknown stream message kind 9"),
    (bytes([2, 7, 0, 0]) + bytes(20), "unsupported stream message version 7"),
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
