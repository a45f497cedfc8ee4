"""Tunnel framing (ADR-0045): many HTTP exchanges and WebSocket sessions over one WebSocket.

Every tunnel message is one binary WebSocket message: a 5-byte header, then a payload::

    kind (uint8) | channel id (uint32, big-endian) | payload

A channel is one tunnelled HTTP request or one tunnelled WebSocket session; the relay picks
its id (odd ids, counting up, never reused on the same tunnel). Payloads of ``OPEN_HTTP``,
``OPEN_WS``, ``RESPONSE``, ``WS_ACCEPT`` and ``CLOSE`` are JSON objects; the others are raw bytes.

HTTP, relay → node: ``OPEN_HTTP`` {method, path, query, headers}, ``DATA``*, ``END``;
node → relay: ``RESPONSE`` {status, headers}, ``DATA``*, ``END`` (a streamed answer, SSE
included, goes through chunk by chunk). WebSocket: relay → node ``OPEN_WS`` {path, query,
headers, subprotocols}; node → relay ``WS_ACCEPT`` {subprotocol} or ``CLOSE``; then
``WS_TEXT``/``WS_BINARY`` both ways, and ``CLOSE`` {code, reason} from either side ends it.
``CLOSE`` on an HTTP channel aborts the exchange (the relay answers 502 if nothing was sent yet).
A body is cut into ``DATA`` frames of at most :data:`MAX_CHUNK_BYTES`.

Pure and service-free (no I/O): the hub and the node's tunnel both use it.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass

from meshnet.errors import InvalidRequest

__all__ = ["Frame", "Kind", "MAX_CHUNK_BYTES", "MAX_FRAME_BYTES", "chunks", "decode_frame", "encode_frame",
           "json_frame"]

_HEADER = struct.Struct("!BI")
#: largest body piece one DATA frame carries, bytes
MAX_CHUNK_BYTES = 256 * 1024
#: largest tunnel message either side accepts, bytes (a chunk, or a WebSocket message passed on whole)
MAX_FRAME_BYTES = 64 * 1024 * 1024 + _HEADER.size
#: largest JSON payload (request heads, close reasons), bytes
MAX_JSON_BYTES = 64 * 1024


class Kind(enum.IntEnum):
    """What a frame says about its channel."""

    OPEN_HTTP = 1
    OPEN_WS = 2
    RESPONSE = 3
    WS_ACCEPT = 4
    DATA = 5
    END = 6
    WS_TEXT = 7
    WS_BINARY = 8
    CLOSE = 9


_JSON_KINDS = frozenset({Kind.OPEN_HTTP, Kind.OPEN_WS, Kind.RESPONSE, Kind.WS_ACCEPT, Kind.CLOSE})


@dataclass(frozen=True)
class Frame:
    """One tunnel message: ``kind`` on channel ``channel`` (0 … 2**32-1) with ``payload`` bytes."""

    kind: Kind
    channel: int
    payload: bytes = b""

    def json(self) -> dict:
        """The payload of a JSON kind, as a dict.

        Raises:
            InvalidRequest (400 ``bad_frame``): not a JSON object.
        """
        try:
            value = json.loads(self.payload) if self.payload else {}
        except ValueError as exc:
            raise InvalidRequest(f"tunnel frame {self.kind.name} on channel {self.channel}: payload is not JSON "
                                 f"({exc})", code="bad_frame") from None
        if not isinstance(value, dict):
            raise InvalidRequest(f"tunnel frame {self.kind.name} on channel {self.channel}: payload is not a JSON "
                                 "object", code="bad_frame")
        return value


def encode_frame(frame: Frame) -> bytes:
    """The bytes of one tunnel message (header + payload).

    Raises:
        InvalidRequest (400 ``bad_frame``): a channel id outside uint32 or a payload over
            :data:`MAX_FRAME_BYTES`.
    """
    if not 0 <= frame.channel < 2**32:
        raise InvalidRequest(f"tunnel channel id {frame.channel} is not a uint32", code="bad_frame")
    if len(frame.payload) + _HEADER.size > MAX_FRAME_BYTES:
        raise InvalidRequest(f"tunnel frame of {len(frame.payload)} bytes is over {MAX_FRAME_BYTES}", code="bad_frame")
    return _HEADER.pack(int(frame.kind), frame.channel) + frame.payload


def decode_frame(data: bytes) -> Frame:
    """Parse one tunnel message written by :func:`encode_frame`.

    Raises:
        InvalidRequest (400 ``bad_frame``): shorter than the header, an unknown kind, a JSON kind
            whose payload is over :data:`MAX_JSON_BYTES`, or a message over :data:`MAX_FRAME_BYTES`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidRequest("tunnel messages are binary, got text", code="bad_frame")
    if len(data) < _HEADER.size:
        raise InvalidRequest(f"tunnel frame of {len(data)} bytes is shorter than its {_HEADER.size}-byte header",
                             code="bad_frame")
    if len(data) > MAX_FRAME_BYTES:
        raise InvalidRequest(f"tunnel frame of {len(data)} bytes is over {MAX_FRAME_BYTES}", code="bad_frame")
    raw_kind, channel = _HEADER.unpack_from(data)
    try:
        kind = Kind(raw_kind)
    except ValueError:
        raise InvalidRequest(f"unknown tunnel frame kind {raw_kind}", code="bad_frame") from None
    payload = bytes(data[_HEADER.size:])
    if kind in _JSON_KINDS and len(payload) > MAX_JSON_BYTES:
        raise InvalidRequest(f"tunnel frame {kind.name} carries {len(payload)} bytes of JSON (at most "
                             f"{MAX_JSON_BYTES})", code="bad_frame")
    return Frame(kind, channel, payload)


def json_frame(kind: Kind, channel: int, value: dict) -> bytes:
    """The encoded frame of a JSON kind carrying ``value``."""
    return encode_frame(Frame(kind, channel, json.dumps(value, separators=(",", ":")).encode()))


def chunks(body: bytes, size: int = MAX_CHUNK_BYTES) -> list[bytes]:
    """``body`` cut into pieces of at most ``size`` bytes (none for an empty body)."""
    return [body[i:i + size] for i in range(0, len(body), size)]
