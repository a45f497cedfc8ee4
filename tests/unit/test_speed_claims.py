"""Measured throughput (ADR-0068, meshnet.tracker.speed): a claim set against the tracker's probes."""

from __future__ import annotations

import pytest

from meshnet.tracker import speed


def test_an_honest_network_keeps_its_claims_exactly():
    """Inflations (claim over probe) within the factor of the lower median: nothing moves."""
    holders = {"a": (100.0, 70.0), "b": (80.0, 75.0), "c": (250.0, 90.0)}  # inflations 1.43, 1.07, 2.78
    assert speed.judge_claims(holders) == {"a": 100.0, "b": 80.0, "c": 250.0}


def test_a_claim_far_beyond_its_probe_is_counted_at_the_probe_times_the_baseline():
    """The issue's attack: 5,000 tokens/s claimed, a probe like its honest peer's."""
    holders = {"liar": (5000.0, 76.0), "honest": (100.0, 80.0), "new": (90.0, None)}
    judged = speed.judge_claims(holders)
    assert judged["liar"] == pytest.approx(76.0 * 100.0 / 80.0)  # 95.0: below the honest holder's 100
    assert judged["honest"] == 100.0 and judged["new"] == 90.0  # not probed yet: its claim


def test_a_holder_claiming_less_than_its_probes_does_not_set_the_bar():
    """Measured on real processes: a busy node's decode average (24) under its probe (55) beside
    honest holders near 1.3 and a node claiming ten times its speed; only that one loses its claim."""
    holders = {"h2": (24.0, 55.0), "entry": (73.0, 55.0), "h1": (52.0, 43.0), "tail": (59.0, 46.0),
               "liar": (380.0, 42.0)}
    judged = speed.judge_claims(holders)
    assert {k for k in holders if judged[k] != holders[k][0]} == {"liar"}
    assert judged["liar"] == pytest.approx(42.0 * 59.0 / 46.0)  # the lower median: tail's 1.28


def test_a_lone_probed_holder_has_no_baseline_and_keeps_its_claim():
    assert speed.judge_claims({"a": (5000.0, 50.0), "b": (100.0, None)}) == {"a": 5000.0, "b": 100.0}


def test_a_modest_claim_is_never_raised_and_a_faster_host_keeps_its_order():
    """A GPU holder whose probe is call-bound (claim 2,000, probe 300: inflation 6.7) beside a CPU
    holder (100 / 77: 1.3, the lower median of two) is counted at 300 x 1.3 = 390: still first,
    never above its claim."""
    judged = speed.judge_claims({"gpu": (2000.0, 300.0), "cpu": (100.0, 77.0)})
    assert judged["gpu"] == pytest.approx(300.0 * 100.0 / 77.0) and judged["gpu"] > judged["cpu"] == 100.0


@pytest.mark.parametrize("probed_at, now, interval, expected", [(None, 5.0, 120.0, True), (0.0, 119.0, 120.0, False),
                                                                (0.0, 120.0, 120.0, True), (None, 5.0, 0.0, False)])
def test_a_shard_is_probed_again_after_the_interval_and_never_when_it_is_zero(probed_at, now, interval, expected):
    assert speed.due(probed_at, interval, now) is expected
