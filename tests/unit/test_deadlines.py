"""Hop deadlines (meshnet.dataplane.deadlines): from a hop's observed call times, with a floor."""

from __future__ import annotations

import pytest

from meshnet.dataplane.deadlines import DeadlinePolicy, StepTimes, deadline_s

POLICY = DeadlinePolicy()  # floor 0.5 s, 4x, cold 2.0 s


def times(step_s: list[float] = (), chunks: list[tuple[int, float]] = ()) -> StepTimes:
    t = StepTimes(POLICY.ema_alpha)
    for s in step_s:
        t.observe(1, s)
    for tokens, s in chunks:
        t.observe(tokens, s)
    return t


@pytest.mark.parametrize("observed, tokens, expected_s", [
    (times(), 1, 2.0),                                  # nothing observed: cold allowance
    (times(), 128, 2.0),
    (times([0.02]), 1, 0.5),                            # 4 x 0.02 = 0.08: the floor applies
    (times([0.125]), 1, 0.5),                           # 4 x 0.125 = 0.5: exactly the floor
    (times([0.2]), 1, 0.8),                             # 4 x 0.2
    (times([1.0]), 1, 4.0),                             # a slow hop gets a long deadline
    (times([0.2, 0.2, 0.2]), 1, 0.8),                   # a steady EMA stays put
    (times([0.05]), 8, 1.6),                            # no chunk seen: 8 tokens x the step
    (times([], [(128, 0.256)]), 128, 1.024),            # 4 x 128 x 0.002 s per token
    (times([], [(128, 0.256)]), 5, 0.5),                # a short chunk: the floor
    (times([], [(128, 0.256)]), 1, 1.024),              # no step seen: a step costs at most the chunk
    (times([0.01], [(128, 0.256)]), 1, 0.5),            # the step EMA wins over the chunk
])
def test_deadline_from_observed_times(observed, tokens, expected_s):
    assert deadline_s(POLICY, observed, tokens) == pytest.approx(expected_s)


def test_step_times_average_with_the_one_bias_corrected_ema_and_follow_a_slowdown():
    times = StepTimes(0.1)
    assert (times.step_s, times.token_s) == (None, None)
    times.observe(1, 0.1)
    assert times.step_s == pytest.approx(0.1) and times.token_s is None  # the first observation as is, not 0.01
    for _ in range(3):
        times.observe(1, 0.1)
    times.observe(1, 1.1)
    # 0.1 x the newest + 0.9 x the earlier sum, over the weights' total 1 - 0.9^5
    assert times.step_s == pytest.approx((0.1 * 1.1 + 0.9 * 0.1 * (1 - 0.9 ** 4)) / (1 - 0.9 ** 5))
    times.observe(8, 0.8)
    assert times.token_s == pytest.approx(0.1) and times.longest_chunk_s == 0.8


def test_a_slow_call_lengthens_the_next_deadline():
    t = times([0.05] * 10)
    before = deadline_s(POLICY, t, 1)
    t.observe(1, 3.0)  # a step that waited behind other sessions' prefill on the node
    assert before == 0.5 and deadline_s(POLICY, t, 1) > 1.0


@pytest.mark.parametrize("bad", [dict(floor_s=0), dict(multiplier=0.5), dict(cold_s=0.1), dict(ema_alpha=0),
                                 dict(probe_timeout_s=-1)])
def test_a_policy_that_makes_no_sense_is_refused(bad):
    with pytest.raises(ValueError):
        DeadlinePolicy(**bad)
