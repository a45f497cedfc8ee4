"""A withheld transcript rebuilt from the hop's receipts and its neighbours' frames (ADR-0067, amended
2026-12-07): :func:`meshnet.dataplane.receipts.rebuild_transcript`."""

from __future__ import annotations

import numpy as np

from meshnet.dataplane.frames import FLAG_REWIND, pack_header
from meshnet.dataplane.receipts import TranscriptStep, rebuild_transcript, sign_step, verify_step
from meshnet.layers import LayerRange
from tests.payloads import node_key

CHAIN, MODEL, LAYERS = "ab" * 16, "tiny-llama", LayerRange(2, 4)


def frame(tokens: int, value: float) -> bytes:
    """A float32 ``[1, tokens, 4]`` frame filled with ``value``."""
    return pack_header("float32", (1, tokens, 4)) + np.full((1, tokens, 4), value, "<f4").tobytes()


def signed(steps: list[TranscriptStep]) -> list:
    """``(position, flags, receipt)`` of each step, signed by node ``h``, in order."""
    return [(s.position, s.flags, sign_step(node_key("h"), MODEL, CHAIN, LAYERS, s.position, s.tokens, s.flags,
                                            s.frame_in, s.frame_out)) for s in steps]


# a prefill of 5, a decode step, a speculative step back at 5 that sent nothing, a decode step
HISTORY = [TranscriptStep(0, 5, 0, frame(5, 0.0), frame(5, 0.5)), TranscriptStep(5, 1, 0, frame(1, 1.0), frame(1, 1.5)),
           TranscriptStep(5, 1, FLAG_REWIND, frame(1, 2.0), None), TranscriptStep(6, 1, 0, frame(1, 3.0), frame(1, 3.5))]


def test_the_frames_a_hops_receipts_name_rebuild_its_transcript_from_any_order_of_its_neighbours_frames():
    receipts = signed(HISTORY)
    ins = [s.frame_in for s in reversed(HISTORY)] + [frame(3, 9.0)]  # the pools' order and extra frames do not matter
    outs = [s.frame_out for s in HISTORY if s.frame_out is not None][::-1]
    assert rebuild_transcript(receipts, ins, outs) == HISTORY
    for s, (_, _, r) in zip(HISTORY, receipts):  # its receipts verify against the rebuilt frames: evidence
        assert verify_step(node_key("h").public_key(), MODEL, CHAIN, LAYERS, s.position, s.tokens, s.flags,
                           s.frame_in, s.frame_out, r) == ""


def test_a_frame_missing_from_the_neighbours_or_no_sessions_history_rebuilds_nothing():
    receipts = signed(HISTORY)
    ins, outs = [s.frame_in for s in HISTORY], [s.frame_out for s in HISTORY if s.frame_out is not None]
    assert rebuild_transcript(receipts, ins[1:], outs) is None  # the first input was not kept
    assert rebuild_transcript(receipts, ins, outs[:-1]) is None  # the last output was not kept
    assert rebuild_transcript(receipts[1:], ins, outs) is None  # a history that starts at position 5
    assert rebuild_transcript([], ins, outs) is None
