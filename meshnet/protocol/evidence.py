"""Evidence that two holders of one layer range computed the same thing (ADR-0042).

Torch-free, so the tracker (admission challenges) and the gateway (spot-checks) share one
measure. Both compare activation frames (the wire format of ADR-0001, read here with numpy)
that two holders returned for the same input:

    distance = ||a - b||_2 / max(||b||_2, 1e-12)      (relative L2, float32 arithmetic)

Honest holders of one recipe agree within :func:`tolerance` (bfloat16 rounding, thread counts,
kernels); a holder with other weights does not. :func:`outvoted` is the majority rule of a
three-holder dispute.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import zstandard

from meshnet.errors import WireError

__all__ = ["TOLERANCE", "challenge_frame", "frame_distance", "outvoted", "read_frame", "tolerance"]

_MAGIC = b"MSHN"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_HEADER = struct.Struct("<4sBBBB")
#: wire dtype code -> (numpy dtype of the raw bytes, bytes per value)
_CODES = {1: (np.uint16, 2), 2: (np.float32, 4), 3: (np.float16, 2)}
#: the largest frame this module reads, bytes (a challenge or a prefill chunk is far smaller)
MAX_FRAME_BYTES = 256 * 1024 * 1024

#: largest relative L2 distance between honest holders' outputs of one hop, by the looser of the
#: two holders' recipes. Measured on SmolLM2-135M (ADR-0042): bfloat16 holders on one host agree
#: exactly (0.0); across thread counts and kernels bfloat16 differs by up to ~0.01; one layer with
#: noise on one weight matrix is 0.2-1.5 away. int8/nf4 holders of one recipe run the same kernels.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05, "int8": 0.15, "nf4": 0.3}


def tolerance(*recipes: str) -> float:
    """The distance within which holders of ``recipes`` (quantization or compute dtype names) agree:
    the loosest of them (an unknown recipe counts as ``nf4``, the loosest known)."""
    return max((TOLERANCE.get(r, TOLERANCE["nf4"]) for r in recipes), default=TOLERANCE["bfloat16"])


def read_frame(body: bytes, max_bytes: int = MAX_FRAME_BYTES) -> np.ndarray:
    """An activation frame (ADR-0001, zstd or raw) as a float32 array of its shape.

    Raises:
        WireError: not a frame (magic, version, dtype, rank, byte count), or larger than ``max_bytes``.
    """
    if body[:4] == _ZSTD_MAGIC:
        try:
            body = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read(max_bytes + 1)
        except zstandard.ZstdError as exc:
            raise WireError(f"corrupt zstd body: {exc}") from exc
    if len(body) > max_bytes or len(body) < _HEADER.size:
        raise WireError(f"activation frame of {len(body)} bytes is not readable")
    magic, version, code, ndim, _ = _HEADER.unpack_from(body)
    if magic != _MAGIC or version != 1 or code not in _CODES or not 1 <= ndim <= 4:
        raise WireError(f"not a meshnet activation frame (magic {magic!r}, version {version}, dtype {code})")
    shape = struct.unpack_from(f"<{ndim}I", body, _HEADER.size)
    raw_dtype, size = _CODES[code]
    payload = body[_HEADER.size + 4 * ndim:]
    if len(payload) != int(np.prod(shape)) * size:
        raise WireError(f"shape {list(shape)} does not match {len(payload)} bytes")
    values = np.frombuffer(payload, dtype=raw_dtype)
    if code == 1:  # bfloat16: the high half of a float32
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32).reshape(shape)


def frame_distance(frame: bytes, reference: bytes) -> float:
    """Relative L2 distance of two activation frames (see the module doc); ``inf`` when their
    shapes differ or a value is not finite.

    Raises:
        WireError: either is not a frame.
    """
    a, b = read_frame(frame), read_frame(reference)
    if a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-12))


def challenge_frame(seed: int, tokens: int, hidden_size: int) -> bytes:
    """A float32 frame ``[1, tokens, hidden_size]`` of standard-normal hidden states from ``seed``:
    the input of an admission challenge (the caller picks the seed at random, so a node cannot
    know it in advance)."""
    data = np.random.default_rng(seed).standard_normal((1, tokens, hidden_size), dtype=np.float32)
    header = _HEADER.pack(_MAGIC, 1, 2, 3, 0) + struct.pack("<3I", 1, tokens, hidden_size)
    return header + data.astype("<f4").tobytes()


def outvoted(checked: str, second: str, third: str, distances: dict[tuple[str, str], float],
             limit: float) -> str | None:
    """Who lost a three-holder vote over one hop, or None when no majority stands.

    Args:
        checked, second, third: the holders (node ids) that ran the same input.
        distances: pairwise distances ``{(a, b): d}`` (either order present is enough).
        limit: agreement threshold (:func:`tolerance`).

    Returns:
        The node id whose output the two others agree against (they agree with each other and
        both disagree with it), else None (also when a pairwise distance is missing).
    """
    def distance(a: str, b: str) -> float | None:
        return distances.get((a, b), distances.get((b, a)))

    if any(distance(a, b) is None for a, b in ((checked, second), (checked, third), (second, third))):
        return None  # a vote needs all three measurements

    def agree(a: str, b: str) -> bool:
        return distance(a, b) <= limit

    for loser, (x, y) in ((checked, (second, third)), (second, (checked, third)), (third, (checked, second))):
        if agree(x, y) and not agree(loser, x) and not agree(loser, y):
            return loser
    return None
