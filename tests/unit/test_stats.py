"""Statistics utilities (meshnet.stats), ADR-0013. Every clock is passed in explicitly."""

from __future__ import annotations

import pytest

from meshnet.stats import EMA, PerformanceEMA, RollingCounter

# (id, alpha, samples, expected value after each sample)
EMA_CASES = [
    ("first sample is reported as itself", 0.1, [4.0], [4.0]),
    # raw: 0.4, then 0.1*2 + 0.9*0.4 = 0.56; weight 1 - 0.81 = 0.19 -> 0.56 / 0.19
    ("second sample, bias-corrected", 0.1, [4.0, 2.0], [4.0, 0.56 / 0.19]),
    ("constant samples stay constant", 0.1, [0.05] * 5, [0.05] * 5),
    ("alpha 1 keeps only the newest", 1.0, [1.0, 7.0, 3.0], [1.0, 7.0, 3.0]),
    # raw: 5, 0.5*1 + 0.5*5 = 3, 0.5*9 + 0.5*3 = 6; weights 0.5, 0.75, 0.875
    ("alpha 0.5 by hand", 0.5, [10.0, 1.0, 9.0], [10.0, 4.0, 6.0 / 0.875]),
]


@pytest.mark.parametrize("alpha, samples, expected",
                         [case[1:] for case in EMA_CASES], ids=[case[0] for case in EMA_CASES])
def test_ema(alpha, samples, expected):
    ema = EMA(alpha)
    assert ema.value == 0.0
    got = [ema.update(sample) for sample in samples]
    assert got == pytest.approx(expected)
    assert ema.value == pytest.approx(expected[-1])
    assert ema.count == len(samples)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_ema_rejects_bad_alpha(alpha):
    with pytest.raises(ValueError):
        EMA(alpha)
    with pytest.raises(ValueError):
        PerformanceEMA(alpha)


# (id, alpha, samples as (n_tokens, seconds), expected tokens/s after each sample)
PERFORMANCE_CASES = [
    ("one sample: its own rate", 0.1, [(10, 1.0)], [10.0]),
    # seconds per token 0.1 then 0.05: (0.1*0.05 + 0.9*0.01) / 0.19 = 0.014 / 0.19 -> 0.19 / 0.014
    ("two samples, averaged as seconds per token", 0.1, [(10, 1.0), (20, 1.0)], [10.0, 0.19 / 0.014]),
    ("steady rate stays put", 0.1, [(32, 2.0)] * 4, [16.0] * 4),
    # alpha 0.5: s/token 0.5 then 0.1 -> raw 0.25, 0.05 + 0.125 = 0.175, weight 0.75 -> 0.175 / 0.75
    ("alpha 0.5 by hand", 0.5, [(2, 1.0), (10, 1.0)], [2.0, 0.75 / 0.175]),
]


@pytest.mark.parametrize("alpha, samples, expected",
                         [case[1:] for case in PERFORMANCE_CASES], ids=[case[0] for case in PERFORMANCE_CASES])
def test_performance_ema(alpha, samples, expected):
    ema = PerformanceEMA(alpha=alpha)
    assert ema.value == 0.0
    got = [ema.update(n_tokens, seconds) for n_tokens, seconds in samples]
    assert got == pytest.approx(expected)
    assert ema.count == len(samples)
    assert ema.alpha == alpha


def test_performance_ema_default_alpha_is_0_1():
    assert PerformanceEMA().alpha == 0.1
    assert EMA().alpha == 0.1


@pytest.mark.parametrize("n_tokens, seconds", [(0, 1.0), (5, 0.0), (-1, 1.0), (5, -2.0)])
def test_performance_ema_rejects_empty_samples(n_tokens, seconds):
    ema = PerformanceEMA()
    with pytest.raises(ValueError):
        ema.update(n_tokens, seconds)
    assert ema.value == 0.0 and ema.count == 0


# (id, window_s, event times, now, expected events per minute)
ROLLING_CASES = [
    ("empty", 60.0, [], 100.0, 0.0),
    ("three events in the last minute", 60.0, [10.0, 20.0, 30.0], 60.0, 3.0),
    ("an event exactly one window old has left", 60.0, [0.0, 30.0], 60.0, 1.0),
    ("an event just inside the window counts", 60.0, [0.5, 30.0], 60.0, 2.0),
    ("all events aged out", 60.0, [1.0, 2.0], 500.0, 0.0),
    ("30 s window scales to per minute", 30.0, [100.0, 110.0, 120.0], 125.0, 6.0),
    ("two minute window halves the count", 120.0, [0.0, 10.0, 20.0, 30.0], 100.0, 2.0),
    ("asking about a moment before the last event", 60.0, [10.0, 20.0, 30.0], 25.0, 2.0),
]


@pytest.mark.parametrize("window_s, times, now, expected",
                         [case[1:] for case in ROLLING_CASES], ids=[case[0] for case in ROLLING_CASES])
def test_rolling_counter(window_s, times, now, expected):
    counter = RollingCounter(window_s=window_s)
    for t in times:
        counter.add(t)
    assert counter.per_minute(now) == pytest.approx(expected)


def test_rolling_counter_memory_is_pruned():
    counter = RollingCounter(window_s=60.0)
    for second in range(10_000):
        counter.add(float(second))
    assert len(counter) == 60  # events at 9940..9999; 9939 is exactly one window old
    assert counter.count(10_000.0) == 59
    assert len(counter) == 59


def test_rolling_counter_uses_the_monotonic_clock_by_default():
    counter = RollingCounter()
    counter.add()
    counter.add()
    assert counter.per_minute() == 2.0


def test_rolling_counter_rejects_empty_window():
    with pytest.raises(ValueError):
        RollingCounter(window_s=0.0)
