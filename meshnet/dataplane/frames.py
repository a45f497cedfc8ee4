"""Activation frames and hop stream messages: the data plane's binary formats, defined once.

Part 1, activation frames (ADR-0001): the one definition of how hidden states travel between hops.

A frame is a fixed header followed by the raw tensor bytes (little-endian, C order), the whole
frame zstd-compressed when that pays::

    offset size  field
    0      4     magic  b"MSHN"
    4      1     version (1)
    5      1     dtype code (1 = bfloat16, 2 = float32, 3 = float16)
    6      1     ndim (1..4)
    7      1     reserved (0)
    8      4*n   shape, uint32 little-endian per dimension
    ...          tensor bytes (prod(shape) * itemsize)

A compressed frame starts with the zstd magic ``28 b5 2f fd``. It is decompressed through a
stream reader that stops one byte past the limit, so a decompression bomb costs at most the
limit. Torch-free: :mod:`meshnet.node.wire` turns frames into tensors on the nodes,
:func:`read_array` into numpy arrays where holders' outputs are compared
(:mod:`meshnet.dataplane.evidence`).

Part 2, hop stream messages: what travels on the WebSocket streams between nodes (ADR-0040).

Every message is one binary WebSocket message: a fixed 32-byte header, then a body::

    offset size  field
    0      1     kind (1 OPEN, 2 STEP, 3 RESULT, 4 ERROR, 5 BUNDLE, 6 RECEIPT)
    1      1     version (2)
    2      1     hop index: the receiver's place in the route (OPEN, STEP), from 0; the
                 sender's place plus one (RESULT, ERROR, RECEIPT), 0 when not given
    3      1     flags (bit 0 LAST_ONLY: the last hop returns only the last position;
                         bit 1 NO_RESULT: it returns nothing, e.g. a failover's replay chunks)
    4      16    chain id: the session id of this chain on every hop, as 16 raw bytes (a uuid)
    20     8     chain key: a random 64-bit secret the entry draws for the chain, sent in its OPEN
    28     4     position, uint32 little-endian (the first token's place in the session)

The chain key authenticates every message after the OPEN (ADR-0049): a hop takes a STEP, and the
entry a RESULT or ERROR, only when it carries the key of the chain's verified OPEN. The chain id
is no secret (it names the session in tickets, releases and the operator's views); the key
travels only inside the chain, so a peer that is not on the route cannot forge a message of it:
it would have to guess 64 random bits, one message per guess, within the chain's lifetime.

A RECEIPT's body is a hop's signed receipt of the step at its position (ADR-0067: two SHA-256
digests and an Ed25519 signature, 128 bytes, :mod:`meshnet.dataplane.receipts`); its flags are
the step's. The body of STEP and RESULT is one activation frame (ADR-0001) passed on as it is; the body
of OPEN is :class:`ChainOpen` and that of ERROR :class:`ChainError`, both JSON. A decode step
thus costs 32 bytes plus the frame (a 20-byte frame header and the hidden state) on each hop.

A BUNDLE carries several messages to the same peer in one WebSocket message (the steps of a
batch leave a node together, ADR-0040's bundle amendment): its chain id is all zeros, its
position the number of messages, and its body each message in order, as a uint32 little-endian
length and the message's bytes. A bundle holds no bundle. Its receiver handles the messages in
order, as if they had come one by one. A bundle of n decode steps costs 32 + 4n bytes more than
its messages: 4 bytes per step, plus 32 shared.

Torch-free and service-free: the entry and every hop parse and build frames and messages here.
"""

from __future__ import annotations

import enum
import hmac
import io
import math
import secrets
import struct
import uuid
from dataclasses import dataclass

import numpy as np
import zstandard
from pydantic import Field, ValidationError

from meshnet.errors import InvalidRequest, PayloadTooLarge, WireError
from meshnet.protocol.control import Payload
from meshnet.protocol.route import HopJSON

__all__ = ["CODES", "ChainError", "ChainOpen", "DEFAULT_MAX_BYTES", "FLAG_LAST_ONLY", "FLAG_NO_RESULT", "FLAG_REWIND",
           "HEADER_REWIND", "Frame",
           "HEADER_BYTES", "ITEM_BYTES", "Kind", "MAGIC", "MAX_NDIM", "MESSAGE_VERSION", "MIN_SAVING", "Message", "NO_KEY",
           "READS_BUNDLES", "STREAM_PATH", "VERSION", "ZSTD_MAGIC", "bundle", "compress", "new_chain_id",
           "new_chain_key", "pack", "pack_header", "read_array", "read_frame", "same_key", "stream_url", "unbundle",
           "unpack"]

MAGIC = b"MSHN"
VERSION = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: wire dtype name -> its code in the header
CODES = {"bfloat16": 1, "float32": 2, "float16": 3}
_NAMES = {code: name for name, code in CODES.items()}
#: bytes per value of each wire dtype
ITEM_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2}
MAX_NDIM = 4
#: default cap on a frame, compressed or not: 256 MiB, far above a 128-token chunk of any served model
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
#: compress only when it saves at least this fraction (ADR-0001: bfloat16 activations rarely do)
MIN_SAVING = 0.10
_HEADER = struct.Struct("<4sBBBB")


@dataclass(frozen=True)
class Frame:
    """A parsed frame: its wire ``dtype`` name, ``shape``, and the raw tensor bytes (``payload``,
    exactly ``prod(shape) * ITEM_BYTES[dtype]`` of them)."""

    dtype: str
    shape: tuple[int, ...]
    payload: memoryview


def pack_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The header of a frame of ``dtype`` (a name of :data:`CODES`) and ``shape``.

    Raises:
        WireError: an unsupported dtype, or a rank outside 1..:data:`MAX_NDIM`.
    """
    if dtype not in CODES:
        raise WireError(f"unsupported wire dtype {dtype}")
    if not 1 <= len(shape) <= MAX_NDIM:
        raise WireError(f"tensor rank {len(shape)} outside 1..{MAX_NDIM}")
    return _HEADER.pack(MAGIC, VERSION, CODES[dtype], len(shape), 0) + struct.pack(f"<{len(shape)}I", *shape)


def compress(raw: bytes, level: int = 1) -> bytes:
    """``raw`` zstd-compressed at ``level`` when that saves :data:`MIN_SAVING` or more, else as it is."""
    packed = zstandard.ZstdCompressor(level=level).compress(raw)
    return packed if len(packed) <= len(raw) * (1 - MIN_SAVING) else raw


def _decompress(body: bytes, max_bytes: int) -> bytes:
    try:
        out = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read(max_bytes + 1)
    except zstandard.ZstdError as exc:
        raise WireError(f"corrupt zstd body: {exc}") from exc
    if len(out) > max_bytes:
        raise PayloadTooLarge(f"decompressed activation exceeds the {max_bytes}-byte limit")
    return out


def read_frame(body: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Frame:
    """Parse a frame (zstd or raw).

    Raises:
        PayloadTooLarge: the body, or the decompressed body, is larger than ``max_bytes`` (HTTP 413).
        WireError: bad magic, unknown version or dtype, a rank outside 1..4, or a shape that does
            not match the byte count (HTTP 400).
    """
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"activation body of {len(body)} bytes exceeds the {max_bytes}-byte limit")
    if body[:4] == ZSTD_MAGIC:
        body = _decompress(body, max_bytes)
    if len(body) < _HEADER.size:
        raise WireError(f"truncated activation: {len(body)} bytes is shorter than the header")
    magic, version, code, ndim, _ = _HEADER.unpack_from(body)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a meshnet activation frame")
    if version != VERSION:
        raise WireError(f"unsupported frame version {version}")
    if code not in _NAMES:
        raise WireError(f"unknown dtype code {code}")
    if not 1 <= ndim <= MAX_NDIM:
        raise WireError(f"rank {ndim} outside 1..{MAX_NDIM}")
    offset = _HEADER.size + 4 * ndim
    if len(body) < offset:
        raise WireError("truncated activation: shape field incomplete")
    shape = struct.unpack_from(f"<{ndim}I", body, _HEADER.size)
    dtype = _NAMES[code]
    expected = math.prod(shape) * ITEM_BYTES[dtype]
    payload = memoryview(body)[offset:]
    if len(payload) != expected:
        raise WireError(f"shape {list(shape)} needs {expected} bytes of {dtype}, body has {len(payload)}")
    return Frame(dtype, tuple(shape), payload)


#: numpy dtype of each wire dtype's raw values (bfloat16 has none: read as uint16)
_NUMPY = {"bfloat16": np.uint16, "float32": np.float32, "float16": np.float16}


def read_array(body: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """A frame as a float32 numpy array of its shape (bfloat16 values widened exactly).

    Raises:
        PayloadTooLarge, WireError: as :func:`read_frame`.
    """
    frame = read_frame(body, max_bytes)
    values = np.frombuffer(frame.payload, dtype=_NUMPY[frame.dtype])
    if frame.dtype == "bfloat16":  # the high half of a float32
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32).reshape(frame.shape)


# --- hop stream messages (ADR-0040, ADR-0049) ---
#: the node route that accepts hop streams; appended to a hop's endpoint (which may carry a path prefix)
STREAM_PATH = "/v1/stream"
#: the WebSocket subprotocol (RFC 6455 section 1.9) a stream's opener offers and a node that reads
#: BUNDLE messages accepts. A peer that accepts none (a node from before bundles) is sent every
#: message alone: it would drop a bundle as an unknown kind (ADR-0040's bundle amendment).
READS_BUNDLES = "meshnet-stream.bundles"
#: 2: the header carries the chain key (ADR-0049); a version-1 message is refused
MESSAGE_VERSION = 2
#: the last hop sends back only the last position ``[1, 1, hidden]`` (prefill chunks, decode)
FLAG_LAST_ONLY = 1
#: the last hop sends nothing back (a failover's replay chunks: only the KV caches matter)
FLAG_NO_RESULT = 2
#: a speculative step (ADR-0058): each hop first takes the session back to the step's position,
#: forgetting the drafts the entry rejected (at most ``MAX_REWIND`` positions)
FLAG_REWIND = 4
#: the HTTP path's mark of a speculative step (``POST /v1/forward``), as :data:`FLAG_REWIND`
HEADER_REWIND = "X-Meshnet-Rewind"
_MESSAGE_HEADER = struct.Struct("<BBBB16s8sI")
HEADER_BYTES = _MESSAGE_HEADER.size  # 32
#: the key of a message that belongs to no chain (a BUNDLE), or that a test leaves unkeyed
NO_KEY = "0" * 16
_LENGTH = struct.Struct("<I")  # a bundled message's length


class Kind(enum.IntEnum):
    """What a message does."""

    OPEN = 1    #: entry → hop 1 → … → last hop: the route, tickets and return address of a chain
    STEP = 2    #: hop k → hop k+1: the activations of one prefill chunk or decode step
    RESULT = 3  #: last hop → entry: the chain's output for one step
    ERROR = 4   #: any hop → entry: a step (or the chain) failed, naming the hop at fault
    BUNDLE = 5  #: node → peer: several of the above, in order, in one WebSocket message
    RECEIPT = 6  #: any hop → entry: the hop's signed receipt of one step (ADR-0067, :mod:`meshnet.dataplane.receipts`)


@dataclass(frozen=True)
class Message:
    """One stream message. ``chain_id`` is a 32-character hex session id, ``key`` the chain's
    16-character hex secret (:func:`new_chain_key`); ``body`` the raw body."""

    kind: Kind
    chain_id: str
    position: int = 0
    hop_index: int = 0
    flags: int = 0
    body: bytes = b""
    key: str = NO_KEY

    @property
    def last_only(self) -> bool:
        return bool(self.flags & FLAG_LAST_ONLY)

    @property
    def no_result(self) -> bool:
        return bool(self.flags & FLAG_NO_RESULT)

    @property
    def rewind(self) -> bool:
        return bool(self.flags & FLAG_REWIND)


def stream_url(endpoint: str) -> str:
    """The hop-stream URL of a node at ``endpoint``: ``http`` becomes ``ws``, ``https`` ``wss``, and
    :data:`STREAM_PATH` is appended to whatever path the endpoint has (a relay's prefix stays).

    Raises:
        InvalidRequest: the endpoint is not an http(s) URL.
    """
    base = endpoint.rstrip("/")
    for scheme, ws in (("http://", "ws://"), ("https://", "wss://")):
        if base[:len(scheme)].lower() == scheme:
            return ws + base[len(scheme):] + STREAM_PATH
    raise InvalidRequest(f"hop endpoint {endpoint!r} is not an http:// or https:// URL", code="invalid_field")


def new_chain_id() -> str:
    """A fresh chain id (32 lowercase hex characters: a uuid4)."""
    return uuid.uuid4().hex


def new_chain_key() -> str:
    """A fresh chain key: 64 random bits as 16 lowercase hex characters (the entry draws one
    for every chain it opens, a failover's new chain included)."""
    return secrets.token_hex(8)


def same_key(message: Message, key: str) -> bool:
    """Whether ``message`` carries the chain key ``key`` (compared in constant time)."""
    return hmac.compare_digest(message.key, key)


def _chain_id_bytes(chain_id: str) -> bytes:
    try:
        return uuid.UUID(hex=chain_id).bytes
    except (ValueError, TypeError, AttributeError):
        raise InvalidRequest(f"chain id must be 32 hex characters, got {chain_id!r}", code="invalid_field") from None


def _key_bytes(key: str) -> bytes:
    try:
        raw = bytes.fromhex(key)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 8 or len(key) != 16:
        raise InvalidRequest(f"chain key must be 16 hex characters, got {key!r}", code="invalid_field")
    return raw


def pack(kind: Kind, chain_id: str, *, key: str = NO_KEY, position: int = 0, hop_index: int = 0, flags: int = 0,
         body: bytes = b"") -> bytes:
    """One message's bytes (header + ``body``); ``key`` is the chain's key (:func:`new_chain_key`).

    Raises:
        InvalidRequest: ``chain_id`` is not 32 hex characters, ``key`` not 16, or a field is out of its
            range (``hop_index`` and ``flags`` 0..255, ``position`` 0..2**32-1).
    """
    raw_id, raw_key = _chain_id_bytes(chain_id), _key_bytes(key)
    try:
        return _MESSAGE_HEADER.pack(int(kind), MESSAGE_VERSION, hop_index, flags, raw_id, raw_key, position) + body
    except struct.error as exc:
        raise InvalidRequest(f"stream message field out of range: {exc}", code="invalid_field") from None


def unpack(data: bytes) -> Message:
    """Parse one message (the body is a view-free copy of the bytes after the header).

    Raises:
        InvalidRequest: shorter than the header, an unknown kind or version.
    """
    if len(data) < HEADER_BYTES:
        raise InvalidRequest(f"stream message of {len(data)} bytes is shorter than its {HEADER_BYTES}-byte header",
                             code="invalid_stream_message")
    kind, version, hop_index, flags, raw_id, raw_key, position = _MESSAGE_HEADER.unpack_from(data)
    if version != MESSAGE_VERSION:
        raise InvalidRequest(f"unsupported stream message version {version}", code="invalid_stream_message")
    try:
        kind = Kind(kind)
    except ValueError:
        raise InvalidRequest(f"unknown stream message kind {kind}", code="invalid_stream_message") from None
    return Message(kind, uuid.UUID(bytes=raw_id).hex, position, hop_index, flags, bytes(data[HEADER_BYTES:]),
                   raw_key.hex())


def bundle(messages: list[bytes]) -> bytes:
    """One BUNDLE message carrying ``messages`` (each a packed message, none a bundle) in order.

    Raises:
        InvalidRequest: no message, or more than 2**32-1.
    """
    if not messages:
        raise InvalidRequest("a bundle carries at least one message", code="invalid_field")
    parts = [pack(Kind.BUNDLE, _NIL, position=len(messages))]
    for data in messages:
        parts += (_LENGTH.pack(len(data)), data)
    return b"".join(parts)


def unbundle(message: Message) -> list[bytes]:
    """The messages a BUNDLE carries, in order (each to :func:`unpack`).

    Raises:
        InvalidRequest: the body ends inside a length, a message runs past the body, the count
            differs from the header's, or a bundled message is itself a bundle.
    """
    body, out, at = message.body, [], 0
    view = memoryview(body)
    while at < len(body):
        if at + _LENGTH.size > len(body):
            raise InvalidRequest(f"bundle body ends inside a length at byte {at}", code="invalid_stream_message")
        (size,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        if at + size > len(body):
            raise InvalidRequest(f"bundled message {len(out)} of {size} bytes runs past the bundle's end",
                                 code="invalid_stream_message")
        if size and body[at] == Kind.BUNDLE:
            raise InvalidRequest(f"bundled message {len(out)} is itself a bundle", code="invalid_stream_message")
        out.append(bytes(view[at:at + size]))
        at += size
    if len(out) != message.position:
        raise InvalidRequest(f"bundle header counts {message.position} messages, its body holds {len(out)}",
                             code="invalid_stream_message")
    return out


_NIL = "0" * 32  # the chain id of a bundle: it belongs to no chain


class ChainOpen(Payload):
    """Body of OPEN: everything a hop needs to serve its part of a chain.

    ``hops`` are the remote hops in order (inclusive layers, ADR-0002); ``tickets[i]`` is the
    session ticket naming ``hops[i]`` (ADR-0038; None on a mesh without tickets); ``entry`` and
    ``entry_endpoint`` are where the last hop sends results and any hop sends errors.
    """

    model: str | None = None
    entry: str = Field(min_length=1)
    entry_endpoint: str = Field(min_length=1)
    hops: list[HopJSON] = Field(min_length=1, max_length=64)
    tickets: list[str | None]
    #: every hop sends the entry a signed RECEIPT of each step (ADR-0067); an entry that cannot
    #: read receipts leaves it off
    receipts: bool = False

    def to_body(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_body(cls, body: bytes) -> "ChainOpen":
        """Raises: InvalidRequest naming the field (bad JSON, missing field, tickets not one per hop)."""
        try:
            opened = cls.model_validate_json(body)
        except ValidationError as exc:
            raise InvalidRequest(f"bad chain OPEN: {_first_error(exc)}", code="invalid_stream_message") from None
        if len(opened.tickets) != len(opened.hops):
            raise InvalidRequest(f"chain OPEN has {len(opened.tickets)} tickets for {len(opened.hops)} hops",
                                 code="invalid_stream_message")
        return opened


class ChainError(Payload):
    """Body of ERROR: ``node_id`` is the hop at fault (the sender itself, or the next hop it could
    not reach), ``code`` the error code (``hop_unreachable``, ``session_conflict``, ...)."""

    node_id: str
    code: str
    message: str
    status: int = 502

    def to_body(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_body(cls, body: bytes) -> "ChainError":
        """Raises: InvalidRequest naming the field."""
        try:
            return cls.model_validate_json(body)
        except ValidationError as exc:
            raise InvalidRequest(f"bad chain ERROR: {_first_error(exc)}", code="invalid_stream_message") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "body"
    return f"{where}: {err.get('msg')}"
