"""Activation frames to and from torch tensors: the nodes' adapter of
:mod:`meshnet.dataplane.frames`, which defines the format (header, dtype codes, zstd rules and
limits; ADR-0001). Encoding and decoding big frames runs off the event loop
(:func:`encode_async`, :func:`decode_async`, :func:`decode_soon`).
"""

from __future__ import annotations

import asyncio

import torch

from meshnet.dataplane import frames
from meshnet.dataplane.frames import DEFAULT_MAX_BYTES, MAGIC, MAX_NDIM, MIN_SAVING, VERSION, ZSTD_MAGIC  # noqa: F401 - re-exported
from meshnet.errors import WireError

#: torch dtype of each wire dtype name of :data:`meshnet.dataplane.frames.CODES`
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_WIRE_NAMES = {dtype: name for name, dtype in DTYPE_NAMES.items()}


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
    name = dtype if isinstance(dtype, str) else _WIRE_NAMES.get(dtype)
    if name not in DTYPE_NAMES:
        raise WireError(f"unsupported wire dtype {dtype}")
    header = frames.pack_header(name, tuple(tensor.shape))
    data = tensor.detach().to("cpu", DTYPE_NAMES[name]).contiguous()
    raw = header + data.view(torch.uint8).numpy().tobytes()
    return frames.compress(raw, level) if compress else raw


def decode(body: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, check_finite: bool = True) -> torch.Tensor:
    """Parse a frame back into a tensor (in its wire dtype).

    Raises:
        PayloadTooLarge: body or decompressed body larger than ``max_bytes`` (HTTP 413).
        WireError: bad magic, unknown version or dtype, bad rank, a shape that does not
            match the byte count (:func:`meshnet.dataplane.frames.read_frame`), or non-finite
            values (HTTP 400).
    """
    frame = frames.read_frame(body, max_bytes)
    dtype = DTYPE_NAMES[frame.dtype]
    tensor = torch.frombuffer(bytearray(frame.payload), dtype=dtype).reshape(frame.shape) if len(frame.payload) \
        else torch.empty(frame.shape, dtype=dtype)
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
