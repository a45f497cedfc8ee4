"""Admission decisions as a pure function (ADR-0042); audit verdicts are tests/unit/test_audit_verdicts.py."""

from __future__ import annotations

import pytest

from meshnet.layers import LayerRange
from meshnet.tracker.admission import Holder, Verdict, decide

BF16 = ("bfloat16", "bfloat16")


def holder(node_id: str, start: int, end: int, recipe: tuple[str, str] = BF16) -> Holder:
    return Holder(node_id, f"http://{node_id}", LayerRange(start, end), *recipe)


CANDIDATE = holder("c", 10, 20)


@pytest.mark.parametrize("digest, known, holders, hidden, expected", [
    ("d1", None, [], 576, "unverified"),                                    # the first holder
    ("d1", "d1", [holder("a", 10, 20)], 576, ("a",)),                      # digest matches: challenge
    ("d2", "d1", [holder("a", 10, 20)], 576, "rejected"),                  # another digest: no challenge
    ("", "d1", [holder("a", 10, 20)], 576, ("a",)),                        # no digest reported: challenge decides
    ("d1", None, [holder("a", 0, 15), holder("b", 15, 30)], 576, "unverified"),  # only pieces cover it
    ("d1", None, [holder("z", 0, 30), holder("a", 10, 20), holder("b", 5, 25)], 576, ("a", "b")),  # two, by id
    ("d1", None, [holder("a", 10, 20, ("bfloat16", "float32"))], 576, "unverified"),  # another compute dtype
    ("d1", None, [holder("a", 10, 20, ("int8", "bfloat16"))], 576, "unverified"),     # another quantization
    ("d1", None, [holder("a", 10, 20)], None, "unverified"),               # width unknown: no challenge
])
def test_decide(digest, known, holders, hidden, expected):
    out = decide(CANDIDATE, digest, known, holders, hidden)
    if isinstance(expected, str):
        assert isinstance(out, Verdict) and out.state == expected
    else:
        assert tuple(h.node_id for h in out) == expected


def test_a_trusted_candidate_is_verified_whatever_digest_was_known_and_trusted_references_come_first():
    """ADR-0069: the operator's word verifies a candidate (a forged digest heard first does not bar
    it), and of the covering holders the trusted ones are challenged against first."""
    verdict = decide(CANDIDATE, "real", "forged", [], 64, frozenset({"c"}))
    assert (verdict.state, verdict.reason) == ("verified", "trusted by the operator (meshnet trust)")
    holders = [holder("a", 0, 30), holder("z", 10, 20), holder("b", 5, 25)]
    assert decide(CANDIDATE, "d", "d", holders, 64) == (holders[0], holders[2])
    assert decide(CANDIDATE, "d", "d", holders, 64, frozenset({"z"})) == (holders[1], holders[0])


def test_with_the_models_files_a_candidate_with_no_covering_holder_is_still_challenged():
    lone = holder("c", 0, 4)
    assert decide(lone, "d", None, [], 64, source=True) == ()  # against the files alone
    assert decide(lone, "d", None, [holder("a", 0, 6)], 64, source=True) == (holder("a", 0, 6),)  # their fallback
    assert decide(lone, "d", None, [], None, source=True).state == "unverified"  # no width: no challenge
    assert decide(lone, "d", "e", [], 64, source=True).state == "rejected"  # the digest check comes first
