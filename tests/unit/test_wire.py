"""Activation frames (meshnet.node.wire): exact round trips and one clear error per malformed frame."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.node import wire
from meshnet.errors import InvalidRequest, PayloadTooLarge, WireError


def frame(shape: tuple[int, ...], *, code: int = 2, ndim: int | None = None, magic: bytes = wire.MAGIC,
          version: int = wire.VERSION, payload: bytes | None = None) -> bytes:
    """A hand-built uncompressed frame (float32 zeros unless ``payload`` is given)."""
    ndim = len(shape) if ndim is None else ndim
    header = struct.pack("<4sBBBB", magic, version, code, ndim, 0) + struct.pack(f"<{len(shape)}I", *shape)
    if payload is None:
        numel = 1
        for dim in shape:
            numel *= dim
        payload = bytes(numel * 4)
    return header + payload


def random_hidden(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- round trips ---------------------------------------------------------------------


def test_float32_round_trip_is_bit_exact():
    tensor = random_hidden(1, 7, 64)
    out = wire.decode(wire.encode(tensor, dtype=torch.float32))
    assert out.dtype == torch.float32
    assert out.shape == (1, 7, 64)
    assert torch.equal(out, tensor)


def test_bfloat16_round_trip_is_exact_for_bfloat16_input():
    tensor = random_hidden(2, 5, 64).to(torch.bfloat16)
    out = wire.decode(wire.encode(tensor))  # bfloat16 is the default wire dtype
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, tensor)


def test_float32_input_sent_as_bfloat16_equals_the_bfloat16_cast():
    tensor = random_hidden(1, 3, 64)
    out = wire.decode(wire.encode(tensor, dtype="bfloat16"))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, tensor.to(torch.bfloat16))


def test_float16_round_trip_by_name():
    tensor = random_hidden(4, 8).to(torch.float16)
    assert torch.equal(wire.decode(wire.encode(tensor, dtype="float16")), tensor)


def test_uncompressible_frame_is_sent_raw_with_the_documented_layout():
    tensor = random_hidden(1, 2, 3)
    body = wire.encode(tensor, dtype="float32")
    assert body[:4] == b"MSHN"
    assert body[4:8] == bytes([1, 2, 3, 0])  # version, dtype code float32, ndim, reserved
    assert struct.unpack_from("<3I", body, 8) == (1, 2, 3)
    assert len(body) == 8 + 3 * 4 + 6 * 4


def test_compressible_frame_is_zstd_and_decodes():
    tensor = torch.zeros(1, 128, 64)
    body = wire.encode(tensor, dtype="float32")
    assert body[:4] == wire.ZSTD_MAGIC
    assert len(body) < 1000  # 32 KiB of zeros
    assert torch.equal(wire.decode(body), tensor)


def test_compress_false_always_sends_raw():
    body = wire.encode(torch.zeros(1, 128, 64), dtype="float32", compress=False)
    assert body[:4] == b"MSHN"
    assert len(body) == 8 + 12 + 128 * 64 * 4


def test_empty_sequence_round_trips():
    out = wire.decode(wire.encode(torch.zeros(1, 0, 64), dtype="float32"))
    assert out.shape == (1, 0, 64)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       compress=st.booleans(), seed=st.integers(0, 2**16))
def test_round_trip_any_shape_dtype_and_compression(shape, dtype, compress, seed):
    tensor = random_hidden(*shape, seed=seed).to(dtype)
    out = wire.decode(wire.encode(tensor, dtype=dtype, compress=compress))
    assert out.dtype == dtype
    assert torch.equal(out, tensor)


# ---- encoder errors --------------------------------------------------------------------


def test_encode_rejects_unsupported_dtype():
    with pytest.raises(WireError, match="unsupported wire dtype"):
        wire.encode(torch.zeros(2), dtype=torch.int8)


@pytest.mark.parametrize("shape", [(), (1, 1, 1, 1, 1)], ids=["rank0", "rank5"])
def test_encode_rejects_rank_outside_1_to_4(shape):
    with pytest.raises(WireError, match=rf"tensor rank {len(shape)} outside 1\.\.4"):
        wire.encode(torch.zeros(shape))


# ---- decoder errors --------------------------------------------------------------------


def test_wire_errors_are_client_errors():
    assert issubclass(WireError, InvalidRequest)
    assert WireError("x").status == 400 and WireError("x").code == "invalid_activation"
    assert issubclass(PayloadTooLarge, WireError)
    assert PayloadTooLarge("x").status == 413 and PayloadTooLarge("x").code == "payload_too_large"


def test_truncated_header():
    body = wire.encode(random_hidden(1, 2, 8), dtype="float32")[:5]
    with pytest.raises(WireError, match="truncated activation: 5 bytes is shorter than the header") as info:
        wire.decode(body)
    assert not isinstance(info.value, PayloadTooLarge)


def test_truncated_shape_field():
    body = frame((1, 2, 8))[:8 + 4]  # ndim 3 but only one dimension present
    with pytest.raises(WireError, match="shape field incomplete"):
        wire.decode(body)


def test_truncated_tensor_bytes():
    body = wire.encode(random_hidden(1, 2, 8), dtype="float32", compress=False)[:-4]
    with pytest.raises(WireError, match=r"shape \[1, 2, 8\] needs 64 bytes of float32, body has 60"):
        wire.decode(body)


def test_wrong_magic():
    body = b"NOPE" + wire.encode(random_hidden(1, 2, 8), dtype="float32", compress=False)[4:]
    with pytest.raises(WireError, match="bad magic b'NOPE': not a meshnet activation frame"):
        wire.decode(body)


def test_unknown_version():
    with pytest.raises(WireError, match="unsupported frame version 7"):
        wire.decode(frame((1, 2), version=7))


@pytest.mark.parametrize("code", [0, 4, 255])
def test_unknown_dtype_code(code):
    with pytest.raises(WireError, match=f"unknown dtype code {code}"):
        wire.decode(frame((1, 2), code=code))


def test_shape_does_not_match_byte_count():
    body = frame((1, 3, 8), payload=bytes(2 * 8 * 4))  # header says 3 positions, body carries 2
    with pytest.raises(WireError, match=r"shape \[1, 3, 8\] needs 96 bytes of float32, body has 64"):
        wire.decode(body)


def test_extra_trailing_bytes_are_rejected():
    body = frame((1, 2)) + b"\x00" * 4
    with pytest.raises(WireError, match="needs 8 bytes"):
        wire.decode(body)


@pytest.mark.parametrize("ndim", [0, 5])
def test_bad_rank(ndim):
    body = struct.pack("<4sBBBB", wire.MAGIC, wire.VERSION, 2, ndim, 0) + bytes(64)
    with pytest.raises(WireError, match=rf"rank {ndim} outside 1\.\.4"):
        wire.decode(body)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_values_are_rejected(bad):
    tensor = random_hidden(1, 4, 8)
    tensor[0, 2, 3] = bad
    body = wire.encode(tensor, dtype="float32")
    with pytest.raises(WireError, match="activation contains NaN or infinite values"):
        wire.decode(body)
    out = wire.decode(body, check_finite=False)
    assert torch.equal(torch.isfinite(out), torch.isfinite(tensor))


def test_body_over_max_bytes():
    body = wire.encode(random_hidden(1, 4, 8), dtype="float32", compress=False)  # 8 + 12 + 128 bytes
    with pytest.raises(PayloadTooLarge, match="activation body of 148 bytes exceeds the 100-byte limit"):
        wire.decode(body, max_bytes=100)
    assert wire.decode(body, max_bytes=148).shape == (1, 4, 8)


def test_decompression_bomb_is_stopped_at_max_bytes():
    body = wire.encode(torch.zeros(1, 256, 64), dtype="float32")  # 64 KiB of zeros
    assert body[:4] == wire.ZSTD_MAGIC and len(body) < 4096
    with pytest.raises(PayloadTooLarge, match="decompressed activation exceeds the 4096-byte limit"):
        wire.decode(body, max_bytes=4096)


def test_streamed_zstd_frame_without_content_size_is_limited_too():
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    body = compressor.compress(frame((1, 1024, 64))) + compressor.flush()
    with pytest.raises(PayloadTooLarge, match="exceeds the 10000-byte limit"):
        wire.decode(body, max_bytes=10_000)


def test_corrupt_zstd_body():
    with pytest.raises(WireError, match="corrupt zstd body"):
        wire.decode(wire.ZSTD_MAGIC + b"\xff" * 32)


def test_truncated_zstd_body():
    body = wire.encode(torch.zeros(1, 256, 64), dtype="float32")
    assert body[:4] == wire.ZSTD_MAGIC
    with pytest.raises(WireError, match="truncated activation"):
        wire.decode(body[:-6])


@pytest.mark.parametrize("positions", [1, 512])  # under and over wire.OFF_LOOP_BYTES (64 KiB of float32)
async def test_async_encode_and_decode_equal_the_sync_ones(positions):
    tensor = torch.randn(1, positions, 64, generator=torch.Generator().manual_seed(positions))
    frame = await wire.encode_async(tensor, dtype="float32")
    assert frame == wire.encode(tensor, dtype="float32")
    assert torch.equal(await wire.decode_async(frame), tensor)
    zeros = wire.encode(torch.zeros(1, positions, 64), dtype="float32")  # compressible: a zstd body
    assert zeros[:4] == wire.ZSTD_MAGIC
    assert torch.equal(await wire.decode_async(zeros), torch.zeros(1, positions, 64))
