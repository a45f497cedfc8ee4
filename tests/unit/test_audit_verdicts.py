"""Receipts, transcripts and the tracker's audit verdicts as pure functions (ADR-0067)."""

from __future__ import annotations

import struct
import uuid

import numpy as np
import pytest

from meshnet.dataplane.frames import FLAG_LAST_ONLY, FLAG_REWIND
from meshnet.dataplane.receipts import NO_OUTPUT, Receipt, TranscriptStep, TranscriptStore, history_problem, \
    read_transcript, sign_step, transcript_json, verify_step
from meshnet.layers import LayerRange
from meshnet.protocol.control import AuditReplay, AuditReport, AuditStep
from meshnet.protocol.signing import b64url
from meshnet.tracker.admission import Holder
from meshnet.tracker.audit import REPLAY_OUTVOTED, AuditCase, AuditVerdict, judge_audit, judge_replay, read_evidence, \
    read_replay
from tests.payloads import node_key

CHAIN = uuid.UUID(int=7).hex
#: the layers of the audited hop (the reports' shard_start 10..shard_end 19)
LAYERS = LayerRange(10, 20)


def frame(array: np.ndarray) -> bytes:
    """A float32 activation frame (ADR-0001) of ``array``."""
    header = struct.pack("<4sBBBB", b"MSHN", 1, 2, array.ndim, 0) + struct.pack(f"<{array.ndim}I", *array.shape)
    return header + array.astype("<f4").tobytes()


def rows(seed: int, tokens: int, width: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, tokens, width)).astype(np.float32)


def test_a_receipt_binds_the_step_to_the_signers_key():
    key = node_key("h1")
    a, b = frame(rows(0, 3)), frame(rows(1, 3))
    receipt = sign_step(key, "m", CHAIN, LAYERS, 5, 3, FLAG_REWIND, a, b)
    assert len(receipt.to_bytes()) == 128 and Receipt.from_bytes(receipt.to_bytes()) == receipt
    public = key.public_key()
    assert verify_step(public, "m", CHAIN, LAYERS, 5, 3, FLAG_REWIND, a, b, receipt) == ""
    assert "output" in verify_step(public, "m", CHAIN, LAYERS, 5, 3, FLAG_REWIND, a, a, receipt)
    assert "input" in verify_step(public, "m", CHAIN, LAYERS, 5, 3, FLAG_REWIND, b, b, receipt)
    assert "not signed" in verify_step(public, "m", CHAIN, LAYERS, 6, 3, FLAG_REWIND, a, b, receipt)  # another position
    assert "not signed" in verify_step(public, "m", CHAIN, LAYERS, 5, 3, 0, a, b, receipt)  # other flags
    assert "not signed" in verify_step(public, "m", CHAIN, LayerRange(10, 19), 5, 3, FLAG_REWIND, a, b, receipt)  # other layers
    assert "not signed" in verify_step(node_key("h2").public_key(), "m", CHAIN, LAYERS, 5, 3, FLAG_REWIND, a, b, receipt)
    assert "not signed" in verify_step(public, "other", CHAIN, LAYERS, 5, 3, FLAG_REWIND, a, b, receipt)  # another model
    assert sign_step(key, "m", CHAIN, LAYERS, 0, 1, 0, a, None).out_digest == NO_OUTPUT


def test_a_transcript_keeps_steps_in_order_for_its_key_and_forgets_them_after_its_time():
    store = TranscriptStore(max_bytes=10_000, keep_s=0.0)
    i = store.record(CHAIN, "k" * 16, TranscriptStep(0, 4, 0, b"in0", None))
    store.record(CHAIN, "k" * 16, TranscriptStep(4, 1, 0, b"in1", None))
    store.set_output(CHAIN, i, b"out0")
    assert [(s.position, s.frame_out) for s in store.steps(CHAIN, "k" * 16)] == [(0, b"out0"), (4, None)]
    assert store.steps(CHAIN, "x" * 16) is None and store.bytes == len(b"in0in1out0")
    doc = transcript_json(CHAIN, "h1", store.steps(CHAIN, "k" * 16))
    assert read_transcript(doc) == store.steps(CHAIN, "k" * 16)
    store.ended(CHAIN)
    assert store.steps(CHAIN, "k" * 16) is None and store.bytes == 0


def test_the_oldest_transcripts_go_when_the_bytes_run_out():
    store = TranscriptStore(max_bytes=10)
    store.record(uuid.UUID(int=1).hex, "k", TranscriptStep(0, 1, 0, b"123456", None))
    store.record(uuid.UUID(int=2).hex, "k", TranscriptStep(0, 1, 0, b"abcdef", None))
    assert store.steps(uuid.UUID(int=1).hex, "k") is None and store.steps(uuid.UUID(int=2).hex, "k") is not None


@pytest.mark.parametrize("steps, why", [
    ([(0, 4, 0), (4, 1, 0), (5, 1, 0)], ""),
    ([(0, 4, 0), (4, 3, FLAG_REWIND), (5, 2, FLAG_REWIND), (7, 1, 0)], ""),  # drafts taken back
    ([(1, 4, 0)], "position 1 where position 0"),
    ([(0, 4, 0), (5, 1, 0)], "position 5 where position 4"),  # a gap
    ([(0, 4, 0), (3, 1, 0)], "position 3 where position 4"),  # an overlap that is no rewind
    ([], "no steps"),
])
def test_a_history_runs_from_position_0_and_only_a_speculative_step_goes_back(steps, why):
    got = history_problem([TranscriptStep(p, t, f, b"", None) for p, t, f in steps])
    assert (why in got) if why else got == ""


def evidence(outputs: list[np.ndarray], *, signer: str = "x", chain: str = CHAIN) -> tuple[AuditReport, list]:
    """A report of x's steps: a 4-token prefill at 0 (last position returned), then decode steps."""
    key, steps, position = node_key(signer), [], 0
    for i, out in enumerate(outputs):
        tokens = 4 if i == 0 else 1
        flags = FLAG_LAST_ONLY
        a, b = frame(rows(10 + i, tokens)), frame(out)
        steps.append(AuditStep(position=position, tokens=tokens, flags=flags, input=b64url(a), output=b64url(b),
                               receipt=b64url(sign_step(key, "m", chain, LAYERS, position, tokens, flags, a, b).to_bytes())))
        position += tokens
    return AuditReport(model="m", shard_start=10, shard_end=19, chain_id=CHAIN, ticket="t", steps=steps), steps


HONEST = [rows(100 + i, 1) for i in range(3)]


def case_of(report: AuditReport) -> AuditCase:
    steps, why = read_evidence(report, node_key("x").public_key())
    assert why == ""
    holder = Holder("x", "http://x", LayerRange(10, 20), "bfloat16", "bfloat16")
    return AuditCase("entry", holder, "m", LayerRange(10, 20), CHAIN, tuple(steps), (), 0.05)


def witness_run(outputs: list[np.ndarray], noise: float = 0.0) -> list[bytes]:
    """A witness's frames: every position of each step (the prefill's first 3 rows arbitrary)."""
    out = []
    for i, last in enumerate(outputs):
        full = np.concatenate([rows(50, 3), last], axis=1) if i == 0 else last
        out.append(frame(full + noise * rows(200 + i, full.shape[1])))
    return out


def test_evidence_the_accused_did_not_sign_is_forged():
    report, _ = evidence(HONEST, signer="y")
    assert "not signed by the node" in read_evidence(report, node_key("x").public_key())[1]
    # the accused's own steps reported as another layer range than it ran (the receipts sign the layers):
    # re-run over layers 10-18 its honest outputs of 10-19 would be outvoted
    report, _ = evidence(HONEST)
    assert "not signed by the node" in read_evidence(report.model_copy(update={"shard_end": 18}),
                                                     node_key("x").public_key())[1]
    report, steps = evidence(HONEST)
    steps[1] = steps[1].model_copy(update={"output": b64url(frame(HONEST[1] + 1.0))})  # the entry changed it
    assert "output at position 4" in read_evidence(report.model_copy(update={"steps": steps}),
                                                   node_key("x").public_key())[1]


def test_the_witnesses_outvote_a_node_that_lied_on_one_decode_step():
    lied = [HONEST[0], HONEST[1] + 0.5, HONEST[2]]
    verdict = judge_audit(case_of(evidence(lied)[0]), {"w1": witness_run(HONEST), "w2": witness_run(HONEST)})
    assert verdict.state == "quarantine"
    assert verdict.distances["w1|w2"] == 0.0 and verdict.distances["x|w1"] > 0.3 and verdict.distances["x|w2"] > 0.3


def test_witnesses_that_agree_with_the_accused_make_the_accusation_false():
    verdict = judge_audit(case_of(evidence(HONEST)[0]), {"w1": witness_run(HONEST), "w2": witness_run(HONEST, 1e-3)})
    assert verdict.state == "false_accusation" and verdict.distances["x|w1"] == 0.0


def test_a_witness_that_answers_unlike_the_accused_and_the_other_witness_is_the_one_outvoted():
    verdict = judge_audit(case_of(evidence(HONEST)[0]), {"w1": witness_run(HONEST), "w2": witness_run(HONEST, 1.0)})
    assert verdict.state == "witness_outvoted" and verdict.outvoted == "w2"
    assert verdict.distances["x|w1"] == 0.0 and verdict.distances["w1|w2"] > 0.3


def test_an_accused_near_the_tolerance_is_no_false_accusation():
    """0.03 from both witnesses: within the tolerance (0.05), but an honest entry's own replay may
    have measured it beyond: inconclusive, and the entry is not counted against."""
    near = [h * 1.03 for h in HONEST]
    verdict = judge_audit(case_of(evidence(near)[0]), {"w1": witness_run(HONEST), "w2": witness_run(HONEST)})
    assert verdict.state == "inconclusive" and "near the tolerance" in verdict.reason
    assert 0.025 < verdict.distances["x|w1"] <= 0.05


@pytest.mark.parametrize("runs, why", [
    ({"w1": "honest"}, "1 witness(es) answered"),
    ({}, "0 witness(es) answered"),
    ({"w1": "honest", "w2": "noisy"}, "disagree with each other"),  # the accused lied: no two of three agree
])
def test_fewer_than_two_agreeing_witnesses_is_inconclusive(runs, why):
    lied = [HONEST[0], HONEST[1] + 0.5, HONEST[2]]
    made = {w: witness_run(HONEST, 0.0 if kind == "honest" else 1.0) for w, kind in runs.items()}
    verdict = judge_audit(case_of(evidence(lied)[0]), made)
    assert verdict.state == "inconclusive" and why in verdict.reason


REPLAY_SESSION = uuid.UUID(int=9).hex
FALSE = AuditVerdict("false_accusation", "w1, w2 agree with x", {"x|w1": 0.0, "x|w2": 0.0})


def replay_of(noise: float = 0.0, *, chunks: tuple[int, ...] = (6,), signer: str = "r",
              inputs: np.ndarray | None = None) -> AuditReplay:
    """The entry's witness r's signed run of x's inputs (6 positions: evidence()'s 4 + 1 + 1), cut
    into ``chunks``, every position returned (the prefill's first 3 rows as witness_run's)."""
    given = np.concatenate([rows(10, 4), rows(11, 1), rows(12, 1)], axis=1) if inputs is None else inputs
    out = np.concatenate([rows(50, 3), *HONEST], axis=1)
    out = out + noise * rows(300, 6)
    key, steps, position = node_key(signer), [], 0
    for n in chunks:
        a, b = frame(given[:, position:position + n]), frame(out[:, position:position + n])
        steps.append(AuditStep(position=position, tokens=n, flags=0, input=b64url(a), output=b64url(b),
                               receipt=b64url(sign_step(key, "m", REPLAY_SESSION, LAYERS, position, n, 0, a, b).to_bytes())))
        position += n
    return AuditReplay(witness="r", session=REPLAY_SESSION, steps=steps)


def weigh(replay: AuditReplay) -> AuditVerdict:
    calls, why = read_replay(replay, "m", LAYERS, node_key("r").public_key())
    assert why == ""
    return judge_replay(case_of(evidence(HONEST)[0]), calls, "r", {"w1": witness_run(HONEST),
                                                                   "w2": witness_run(HONEST)}, FALSE)


@pytest.mark.parametrize("chunks", [(6,), (4, 2), (2, 2, 2)])
def test_a_replay_the_accused_and_the_trackers_witnesses_all_disagree_with_outvotes_the_entrys_witness(chunks):
    """The entry's own witness lied to it: the tracker's holders agree with the accused, and the
    witness's own signed replay shows why the entry disputed (ADR-0067, amended 2026-12-07)."""
    verdict = weigh(replay_of(1.0, chunks=chunks))
    assert verdict.state == REPLAY_OUTVOTED and verdict.outvoted == "r"
    assert verdict.distances["x|r"] > 0.3 and verdict.distances["w1|r"] > 0.3 and verdict.distances["w2|r"] > 0.3
    assert verdict.distances["x|w1"] == 0.0
    assert verdict.to_json()["outvoted"] == "r"


def test_a_replay_that_agrees_with_the_accused_leaves_the_accusation_false():
    verdict = weigh(replay_of(0.0, chunks=(4, 2)))
    assert verdict.state == "false_accusation" and "replay agrees with w1, w2, x" in verdict.reason
    assert verdict.distances["x|r"] == 0.0


def test_a_replay_of_other_inputs_proves_nothing():
    other = np.concatenate([rows(10, 4), rows(11, 1), rows(99, 1)], axis=1)  # the last input is not x's
    verdict = weigh(replay_of(1.0, inputs=other))
    assert verdict.state == "false_accusation" and "did not run the accused's inputs in run 0" in verdict.reason


def test_a_replay_its_witness_did_not_sign_does_not_read():
    assert "not signed by the node" in read_replay(replay_of(1.0, signer="y"), "m", LAYERS,
                                                   node_key("r").public_key())[1]
    # a replay the witness ran through other layers than the dispute's (a ticket for a sub-range)
    assert "not signed by the node" in read_replay(replay_of(1.0), "m", LayerRange(10, 19), node_key("r").public_key())[1]
    assert "not signed by the node" in read_replay(replay_of(1.0), "other", LAYERS, node_key("r").public_key())[1]
    gap = replay_of(1.0, chunks=(4, 2))
    gap = gap.model_copy(update={"steps": gap.steps[1:]})
    assert "no session's history" in read_replay(gap, "m", LAYERS, node_key("r").public_key())[1]


def test_a_witness_whose_own_re_run_for_the_tracker_disagrees_with_the_replay_it_signed_is_outvoted():
    """Three holders of a range: the entry's witness r is also one of the tracker's two; it answers
    the tracker honestly, and what it signed for the entry is unlike its own re-run."""
    calls, _ = read_replay(replay_of(1.0), "m", LAYERS, node_key("r").public_key())
    verdict = judge_replay(case_of(evidence(HONEST)[0]), calls, "r", {"w1": witness_run(HONEST),
                                                                      "r": witness_run(HONEST)}, FALSE)
    assert verdict.state == REPLAY_OUTVOTED and verdict.outvoted == "r" and verdict.distances["r|r"] > 0.3


def test_a_replay_against_one_witness_or_from_the_accused_changes_nothing():
    calls, _ = read_replay(replay_of(1.0), "m", LAYERS, node_key("r").public_key())
    alone = judge_replay(case_of(evidence(HONEST)[0]), calls, "r", {"w1": witness_run(HONEST)}, FALSE)
    assert alone.state == "false_accusation" and "that needs two" in alone.reason
    own = judge_replay(case_of(evidence(HONEST)[0]), calls, "x", {"w1": witness_run(HONEST),
                                                                  "w2": witness_run(HONEST)}, FALSE)
    assert own.state == "false_accusation" and "comes from the accused" in own.reason
