"""The entry side of an audit's replay evidence (ADR-0067, amended 2026-12-07): which of the
witness's signed calls go with a dispute, and receipts checked before they are sent."""

from __future__ import annotations

import uuid

import httpx

from meshnet.dataplane.frames import FLAG_REWIND
from meshnet.dataplane.receipts import TranscriptStep, sign_step
from meshnet.layers import LayerRange
from meshnet.gateway.audit import AuditStats, Auditor, _Replay
from meshnet.node.metrics import NodeMetrics
from meshnet.protocol.signing import encode_public_key
from tests.payloads import node_key

SESSION = uuid.UUID(int=3).hex
LAYERS = LayerRange(10, 20)
MODEL = "smollm2-135m-instruct"


def step(position: int, tokens: int, flags: int = 0, out: bytes | None = b"out") -> TranscriptStep:
    return TranscriptStep(position, tokens, flags, f"in{position}".encode(), out)


def replay(calls: list[tuple[int, TranscriptStep]], signer: str = "w") -> _Replay:
    key = node_key(signer)
    return _Replay("w", SESSION, [(k, c, sign_step(key, MODEL, SESSION, LAYERS, c.position, c.tokens, c.flags, c.frame_in,
                                                   c.frame_out)) for k, c in calls])


def test_a_dispute_carries_the_calls_of_its_runs_up_to_the_one_holding_the_disputed_step():
    # audited: a 4-token prefill, two decode steps, a speculative step back at 5, one more decode step
    audited = [step(0, 4), step(4, 1), step(5, 1), step(5, 2, FLAG_REWIND), step(7, 1)]
    # the witness replayed run 0 (positions 0-5) in chunks of 4, the speculative step alone, then run 2
    calls = [(0, step(0, 4)), (0, step(4, 2)), (1, step(5, 2, FLAG_REWIND)), (2, step(7, 1))]
    whole = replay(calls)
    assert [c.position for c in whole.upto(audited[:2]).steps] == [0, 4]      # position 4 is in the 2nd chunk
    assert [c.position for c in whole.upto(audited[:1]).steps] == [0]         # the prefill alone
    assert [c.position for c in whole.upto(audited[:4]).steps] == [0, 4, 5]   # up to the speculative step
    assert [c.position for c in whole.upto(audited).steps] == [0, 4, 5, 7]
    assert whole.upto(audited[:2]).receipts == whole.receipts[:2]


async def test_receipts_are_checked_against_the_key_the_tracker_binds_before_they_go_as_evidence():
    keys = {"w": encode_public_key(node_key("w").public_key())}

    async def lookup(node_id: str) -> str | None:
        return keys.get(node_id)

    async with httpx.AsyncClient() as client:
        auditor = Auditor(client=client, routes=None, report=None, keys=lookup)
        signed = replay([(0, step(0, 4))])
        assert await auditor._unverified("w", MODEL, SESSION, LAYERS, signed.steps, signed.receipts) == ""
        forged = replay([(0, step(0, 4))], signer="x")
        assert "not signed by the node" in await auditor._unverified("w", MODEL, SESSION, LAYERS, forged.steps, forged.receipts)
        assert "knows no key of y" in await auditor._unverified("y", MODEL, SESSION, LAYERS, signed.steps, signed.receipts)
        assert "not signed by the node" in await auditor._unverified(  # signed for another model's layers
            "w", "another-model", SESSION, LAYERS, signed.steps, signed.receipts)
        assert await Auditor(client=client, routes=None, report=None)._unverified(
            "w", MODEL, SESSION, LAYERS, forged.steps, forged.receipts) == ""  # no key lookup: nothing checked here


def test_an_entrys_audits_are_counted_in_its_metrics_once_its_auditor_runs():
    metrics = NodeMetrics()
    assert b"meshnet_entry_audits" not in metrics.render()[0]  # no auditor: no series
    metrics.audit_stats = AuditStats(audits=5, passed=3, disputes=1, unsigned=1)
    text = metrics.render()[0].decode()
    assert 'meshnet_entry_audits_total{outcome="passed"} 3.0' in text
    assert 'meshnet_entry_audits_total{outcome="disputes"} 1.0' in text
    assert 'meshnet_entry_audits_total{outcome="unsigned"} 1.0' in text
    assert 'meshnet_entry_audits_total{outcome="withheld"} 0.0' in text
