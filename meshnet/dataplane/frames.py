"""Activation frames (ADR-0001): the one definition of how hidden states travel between hops.

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
limit. Torch-free: :mod:`meshnet.wire` turns frames into tensors on the nodes,
:func:`read_array` into numpy arrays where holders' outputs are compared
(:mod:`meshnet.dataplane.evidence`).
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from meshnet.errors import PayloadTooLarge, WireError

__all__ = ["CODES", "DEFAULT_MAX_BYTES", "Frame", "ITEM_BYTES", "MAGIC", "MAX_NDIM", "MIN_SAVING", "VERSION",
           "ZSTD_MAGIC", "compress", "pack_header", "read_array", "read_frame"]

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
