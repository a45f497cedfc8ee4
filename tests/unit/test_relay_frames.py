"""Tunnel framing, back-off delays and the relay's share of route cost (ADR-0045)."""

from __future__ import annotations

import random

import pytest

from meshnet.errors import InvalidRequest
from meshnet.relay.backoff import Backoff
from meshnet.relay.frames import (MAX_CHUNK_BYTES, MAX_FRAME_BYTES, Frame, Kind, chunks, decode_frame, encode_frame,
                                  json_frame)
from meshnet.relay.hub import forwardable, relay_prefix
from meshnet.relay.tunnel import ws_url
from meshnet.tracker.routing import RELAY_LATENCY_FLOOR_S, relay_latency_s


@pytest.mark.parametrize("frame, wire", [
    (Frame(Kind.DATA, 1, b"abc"), b"\x05\x00\x00\x00\x01abc"),
    (Frame(Kind.END, 3), b"\x06\x00\x00\x00\x03"),
    (Frame(Kind.WS_BINARY, 2**32 - 1, b"\x00"), b"\x08\xff\xff\xff\xff\x00"),
    (Frame(Kind.CLOSE, 258, b"{}"), b"\x09\x00\x00\x01\x02{}"),
])
def test_frames_encode_to_fixed_bytes_and_back(frame, wire):
    assert encode_frame(frame) == wire
    assert decode_frame(wire) == frame


def test_json_frames_carry_objects():
    data = json_frame(Kind.OPEN_HTTP, 7, {"method": "POST", "path": "/v1/forward", "headers": [["a", "b"]]})
    frame = decode_frame(data)
    assert (frame.kind, frame.channel) == (Kind.OPEN_HTTP, 7)
    assert frame.json() == {"method": "POST", "path": "/v1/forward", "headers": [["a", "b"]]}
    assert Frame(Kind.RESPONSE, 1, b"").json() == {}


@pytest.mark.parametrize("data, message", [
    (b"\x05\x00\x00", "shorter than its 5-byte header"),
    (b"\x63\x00\x00\x00\x01", "unknown tunnel frame kind 99"),
    (b"\x00\x00\x00\x00\x01", "unknown tunnel frame kind 0"),
    (b"\x01\x00\x00\x00\x01" + b"x" * (64 * 1024 + 1), "carries 65537 bytes of JSON"),
    ("text", "binary, got text"),
])
def test_bad_frames_are_refused_with_the_reason(data, message):
    with pytest.raises(InvalidRequest) as exc:
        decode_frame(data)
    assert message in exc.value.message
    assert exc.value.code == "bad_frame"


@pytest.mark.parametrize("payload, message", [(b"[1]", "not a JSON object"), (b"{", "not JSON")])
def test_json_of_a_bad_payload_is_refused(payload, message):
    with pytest.raises(InvalidRequest, match=message):
        Frame(Kind.CLOSE, 1, payload).json()


def test_oversized_frames_and_bad_channels_are_refused():
    with pytest.raises(InvalidRequest, match="not a uint32"):
        encode_frame(Frame(Kind.DATA, 2**32))
    with pytest.raises(InvalidRequest, match="not a uint32"):
        encode_frame(Frame(Kind.DATA, -1))
    big = b"\x05\x00\x00\x00\x01" + bytes(MAX_FRAME_BYTES)
    with pytest.raises(InvalidRequest, match="is over"):
        decode_frame(big)


def test_chunks_cut_a_body_in_pieces_of_at_most_the_chunk_size():
    body = bytes(range(256)) * 5000  # 1,280,000 bytes
    pieces = chunks(body)
    assert [len(p) for p in pieces] == [MAX_CHUNK_BYTES] * 4 + [1_280_000 - 4 * MAX_CHUNK_BYTES]
    assert b"".join(pieces) == body
    assert chunks(b"") == []
    assert chunks(b"abcde", 2) == [b"ab", b"cd", b"e"]


def test_backoff_doubles_within_jitter_up_to_its_bound_and_resets():
    backoff = Backoff(0.5, 5.0, rng=random.Random(7))
    delays = [backoff.next_delay_s() for _ in range(8)]
    bounds = [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    assert all(b / 2 <= d <= b for d, b in zip(delays, bounds)), delays
    assert max(delays) <= 5.0
    backoff.reset()
    assert 0.25 <= backoff.next_delay_s() <= 0.5
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


def test_backoff_jitter_spreads_nodes_that_lost_the_same_relay():
    firsts = {round(Backoff(1.0, 5.0, rng=random.Random(seed)).next_delay_s(), 6) for seed in range(50)}
    assert len(firsts) == 50
    assert min(firsts) >= 0.5 and max(firsts) <= 1.0


def test_relay_latency_counts_only_for_relayed_nodes():
    assert relay_latency_s(None, 0.5) == 0.0
    assert relay_latency_s("http://relay:8700", 0.0) == RELAY_LATENCY_FLOOR_S
    assert relay_latency_s("http://relay:8700", 0.030) == 0.030
    assert relay_latency_s("http://relay:8700", float("nan")) == RELAY_LATENCY_FLOOR_S


def test_relay_names_and_headers():
    assert relay_prefix("http://10.0.0.1:8700/", "n2") == "http://10.0.0.1:8700/v1/relay/n2"
    assert ws_url("http://a:1/x") == "ws://a:1/x" and ws_url("https://a/x") == "wss://a/x"
    assert forwardable({"Host": "a", "Content-Length": "3", "Connection": "keep-alive",
                        "X-Meshnet-Session": "s"}) == [["Content-Length", "3"], ["X-Meshnet-Session", "s"]]


def test_route_prefers_a_direct_holder_to_an_equal_relayed_one():
    from meshnet.layers import LayerRange
    from meshnet.tracker.routing import ShardCandidate, choose_route

    direct = ShardCandidate("b-direct", "http://b", LayerRange(10, 20), 10.0)
    relayed = ShardCandidate("a-relayed", "http://r/v1/relay/a", LayerRange(10, 20), 10.0,
                             latency_s=relay_latency_s("http://r", 0.004))
    entry = ShardCandidate("e", "http://e", LayerRange(0, 10), 10.0)
    assert [h.node_id for h in choose_route(20, [entry, relayed, direct])] == ["e", "b-direct"]
    assert [h.node_id for h in choose_route(20, [entry, relayed])] == ["e", "a-relayed"]
    faster = ShardCandidate("a-relayed", "http://r/v1/relay/a", LayerRange(10, 20), 100.0,
                            latency_s=relay_latency_s("http://r", 0.004))
    assert [h.node_id for h in choose_route(20, [entry, faster, direct])] == ["e", "a-relayed"]
