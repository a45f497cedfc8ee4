"""Binary activation frames: how hidden states travel between hops.

A frame is a 16-byte-aligned fixed header followed by the raw tensor bytes
(little-endian, C order), the whole frame zstd-compressed when that pays::

    offset size  field
    0      4     magic  b"MSHN"
    4      1     version (1)
    5      1     dtype code (1 = bfloat16, 2 = float32, 3 = float16)
    6      1     ndim (1..4)
    7      1     reserved (0)
    8      4*n   shape, uint32 little-endian per dimension
    ...          tensor bytes (prod(shape) * itemsize)

A compressed body starts with the zstd frame magic ``28 b5 2f fd``; the decoder
recognises it and decompresses with a hard output limit before parsing. Decisions and
numbers: docs/adr/0001-wire-format.md.
"""

from __future__ import annotations

import asyncio
import io
import struct

import torch
import zstandard

from meshnet.errors import PayloadTooLarge, WireError

MAGIC = b"MSHN"
VERSION = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DTYPE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float32: 2, torch.float16: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
MAX_NDIM = 4
#: default cap on a decoded frame: 256 MiB, far above a 128-token chunk of any served model
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
#: compress only when it saves at least this fraction (ADR-0001: bfloat16 activations rarely do)
MIN_SAVING = 0.10
_HEADER = struct.Struct("<4sBBBB")


def encode(tensor: torch.Tensor, *, dtype: torch.dtype | str = torch.bfloat16,
           compress: bool = True, level: int = 1) -> bytes:
    """Serialise ``tensor`` into a frame.

    Args:
        tensor: any shape with 1-4 dims (hidden states are ``[batch, seq, hidden]``).
        dtype: wire dtype (bfloat16 default; float32 for exactness checks).
        compress: try zstd (``level``) and keep it when it saves ``MIN_SAVING`` or more.

    Returns:
        The frame bytes.

    Raises:
        WireError: unsupported dtype or rank.
    """
    dtype = DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPE_CODES:
        raise WireError(f"unsupported wire dtype {dtype}")
    if not 1 <= tensor.dim() <= MAX_NDIM:
        raise WireError(f"tensor rank {tensor.dim()} outside 1..{MAX_NDIM}")
    data = tensor.detach().to("cpu", dtype).contiguous()
    header = _HEADER.pack(MAGIC, VERSION, DTYPE_CODES[dtype], data.dim(), 0)
    header += struct.pack(f"<{data.dim()}I", *data.shape)
    raw = header + data.view(torch.uint8).numpy().tobytes()
    if compress:
        packed = zstandard.ZstdCompressor(level=level).compress(raw)
        if len(packed) <= len(raw) * (1 - MIN_SAVING):
            return packed
    return raw


def _decompress(body: bytes, max_bytes: int) -> bytes:
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
        out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as exc:
        raise WireError(f"corrupt zstd body: {exc}") from exc
    if len(out) > max_bytes:
        raise PayloadTooLarge(f"decompressed activation exceeds the {max_bytes}-byte limit")
    return out


def decode(body: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, check_finite: bool = True) -> torch.Tensor:
    """Parse a frame back into a tensor (in its wire dtype).

    Raises:
        PayloadTooLarge: body or decompressed body larger than ``max_bytes`` (HTTP 413).
        WireError: bad magic, unknown version or dtype, bad rank, a shape that does not
            match the byte count, or non-finite values (HTTP 400).
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
    if code not in CODE_DTYPES:
        raise WireError(f"unknown dtype code {code}")
    if not 1 <= ndim <= MAX_NDIM:
        raise WireError(f"rank {ndim} outside 1..{MAX_NDIM}")
    offset = _HEADER.size + 4 * ndim
    if len(body) < offset:
        raise WireError("truncated activation: shape field incomplete")
    shape = struct.unpack_from(f"<{ndim}I", body, _HEADER.size)
    dtype = CODE_DTYPES[code]
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    payload = memoryview(body)[offset:]
    if len(payload) != expected:
        raise WireError(f"shape {list(shape)} needs {expected} bytes of {dtype}, body has {len(payload)}")
    tensor = torch.frombuffer(bytearray(payload), dtype=dtype).reshape(shape) if expected else \
        torch.empty(shape, dtype=dtype)
    if check_finite and not bool(torch.isfinite(tensor).all()):
        raise WireError("activation contains NaN or infinite values")
    return tensor


#: frames bigger than this (bytes) are encoded and decoded in a worker thread
OFF_LOOP_BYTES = 64 * 1024


async def encode_async(tensor: torch.Tensor, **kw) -> bytes:
    """:func:`encode` for async callers: in a worker thread when the tensor is over
    :data:`OFF_LOOP_BYTES`, so a big frame never blocks the event loop (a one-token decode
    step is encoded inline, where a thread hop would cost more than it saves)."""
    if tensor.numel() * tensor.element_size() > OFF_LOOP_BYTES:
        return await asyncio.to_thread(encode, tensor, **kw)
    return encode(tensor, **kw)


def _off_loop(body: bytes) -> bool:
    """Whether ``body`` is decoded in a worker thread: over :data:`OFF_LOOP_BYTES`, or compressed
    (a small zstd body may expand to ``max_bytes``)."""
    return len(body) > OFF_LOOP_BYTES or body[:4] == ZSTD_MAGIC


async def decode_async(body: bytes, **kw) -> torch.Tensor:
    """:func:`decode` for async callers: in a worker thread when the body is big or compressed."""
    if _off_loop(body):
        return await asyncio.to_thread(decode, body, **kw)
    return decode(body, **kw)


def decode_soon(body: bytes, **kw) -> asyncio.Future:
    """Start decoding ``body`` on the running loop and return the future of its tensor (or of its
    :class:`WireError`). A small frame is decoded at once, its future already done (no task,
    no thread: a one-token decode step); a big or compressed one in a worker thread."""
    loop = asyncio.get_running_loop()
    if _off_loop(body):
        return asyncio.ensure_future(asyncio.to_thread(decode, body, **kw))
    future = loop.create_future()
    try:
        future.set_result(decode(body, **kw))
    except Exception as exc:  # noqa: BLE001 - the awaiting step reports it
        future.set_exception(exc)
    return future
