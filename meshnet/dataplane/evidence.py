"""Evidence that two holders of one layer range computed the same thing (ADR-0042).

Torch-free, so the tracker (admission challenges) and the gateway (spot-checks) share one
measure. Both compare activation frames (:mod:`meshnet.dataplane.frames`, read with numpy)
that two holders returned for the same input:

    distance = ||a - b||_2 / max(||b||_2, 1e-12)      (relative L2, float32 arithmetic)

Honest holders of one recipe agree within :func:`tolerance` (bfloat16 rounding, thread counts,
kernels); a holder with other weights does not. :func:`outvoted` is the majority rule of a
three-holder dispute.
"""

from __future__ import annotations

import numpy as np

from meshnet.dataplane.frames import DEFAULT_MAX_BYTES, pack_header, read_array

__all__ = ["AUDIT_TOLERANCE", "TOLERANCE", "audit_tolerance", "challenge_frame", "frame_distance", "outvoted",
           "reference_rows", "step_distances", "tolerance"]

#: the largest frame this module reads, bytes (a challenge or a prefill chunk is far smaller)
MAX_FRAME_BYTES = DEFAULT_MAX_BYTES

#: largest relative L2 distance between honest holders' outputs of one hop, by the looser of the
#: two holders' recipes. Measured on SmolLM2-135M (ADR-0042): bfloat16 holders on one host agree
#: exactly (0.0); across thread counts and kernels bfloat16 differs by up to ~0.01; one layer with
#: noise on one weight matrix is 0.2-1.5 away. int8/int4/nf4 holders of one recipe run the same
#: kernels on the same quantized weights (int4's figure is int8's, not measured across hosts).
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05, "int8": 0.15, "int4": 0.15, "nf4": 0.3}


#: the decode audit's tighter limit (ADR-0067, amended 2026-12-07), where it was measured: the largest
#: step distance of an audit (a hop's signed decode steps against a witness's chunked replay of the
#: same inputs), SmolLM2-135M bfloat16, layers 10-19, ``bench/audits.py``. Honest holders on the row,
#: packed and transposed weight layouts with 1 and 2 threads: 68 audits, p50 0.0, max 0.0138 (237 more
#: on 2026-12-07: all 0.0). A holder with noise of 0.1 x the weight's std on layer 15's MLP
#: down-projection: 0.0157-0.0404 over its audits (beyond the limit in all but one); 0.05 x: 0.0104-0.0203,
#: mostly inside the honest spread (not separable). The limit is 1.3 x the honest maximum. Other
#: recipes keep :data:`TOLERANCE` until measured.
AUDIT_TOLERANCE = {"bfloat16": 0.018}


def audit_tolerance(*recipes: str) -> float:
    """The step distance within which holders of ``recipes`` agree in a decode audit: the loosest of
    them, each recipe's :data:`AUDIT_TOLERANCE` where measured, else its :data:`TOLERANCE`."""
    return max((AUDIT_TOLERANCE.get(r) or tolerance(r) for r in recipes), default=AUDIT_TOLERANCE["bfloat16"])


def tolerance(*recipes: str) -> float:
    """The distance within which holders of ``recipes`` (quantization or compute dtype names) agree:
    the loosest of them (an unknown recipe counts as ``nf4``, the loosest known)."""
    return max((TOLERANCE.get(r, TOLERANCE["nf4"]) for r in recipes), default=TOLERANCE["bfloat16"])


def frame_distance(frame: bytes, reference: bytes) -> float:
    """Relative L2 distance of two activation frames (see the module doc); ``inf`` when their
    shapes differ or a value is not finite.

    Raises:
        WireError: either is not a frame.
    """
    a, b = read_array(frame, MAX_FRAME_BYTES), read_array(reference, MAX_FRAME_BYTES)
    if a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-12))


def challenge_frame(seed: int, tokens: int, hidden_size: int) -> bytes:
    """A float32 frame ``[1, tokens, hidden_size]`` of standard-normal hidden states from ``seed``:
    the input of an admission challenge (the caller picks the seed at random, so a node cannot
    know it in advance)."""
    data = np.random.default_rng(seed).standard_normal((1, tokens, hidden_size), dtype=np.float32)
    return pack_header("float32", (1, tokens, hidden_size)) + data.astype("<f4").tobytes()


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


def step_distances(outputs: list[tuple[int, int, int, bytes]], reference: np.ndarray) -> list[float]:
    """Relative L2 distance of each step's output to a reference run of the same inputs (ADR-0067).

    Args:
        outputs: ``(position, tokens, flags, output frame)`` of the audited hop's steps; an output
            holds every position of its step, or only the last with :data:`FLAG_LAST_ONLY`.
        reference: ``[positions, hidden]`` float32 rows, every position from 0 of a second holder's
            run over the same inputs (a prefill of the whole history).

    Returns:
        One distance per step, in order (``inf`` when the step's rows are not in ``reference``,
        its shape differs or a value is not finite).

    Raises:
        WireError: an output is not a frame.
    """
    out = []
    for position, tokens, flags, frame in outputs:
        rows = read_array(frame, MAX_FRAME_BYTES)
        rows = rows.reshape(-1, rows.shape[-1]) if rows.ndim > 1 else rows.reshape(1, -1)
        end = position + tokens
        ref = reference[end - rows.shape[0]:end] if end <= reference.shape[0] else None
        if ref is None or ref.shape != rows.shape or not (np.isfinite(rows).all() and np.isfinite(ref).all()):
            out.append(float("inf"))
            continue
        out.append(float(np.linalg.norm(rows - ref) / max(float(np.linalg.norm(ref)), 1e-12)))
    return out


def reference_rows(frames: list[bytes]) -> np.ndarray:
    """The ``[positions, hidden]`` float32 rows of consecutive ``[1, seq, hidden]`` output frames of
    one run (every position returned), joined in order.

    Raises:
        WireError: a frame does not read.
    """
    arrays = [read_array(f, MAX_FRAME_BYTES) for f in frames]
    return np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrays], axis=0)
