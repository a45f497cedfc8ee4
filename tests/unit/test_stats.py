"""Statistics utilities (meshnet.stats), ADR-0013. Every clock is passed in explicitly."""

from __future__ import annotations

import pytest

from meshnet.stats import EMA, ExpiringDict, PerformanceEMA, RollingCounter

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


def test_expiring_dict_get_and_expiry_boundary():
    beats = ExpiringDict(ttl_s=30.0)
    beats.set("node-a", {"in_flight": 1}, now=100.0)
    assert beats.get("node-a", now=100.0) == {"in_flight": 1}
    assert beats.get("node-a", now=129.999) == {"in_flight": 1}
    assert beats.get("node-a", now=130.0) is None  # live while now < set time + ttl
    assert beats.get("node-a", "gone", now=130.0) == "gone"
    assert beats.get("missing", now=100.0) is None


def test_expiring_dict_set_refreshes_the_deadline():
    beats = ExpiringDict(ttl_s=30.0)
    beats.set("a", 1, now=0.0)
    beats.set("b", 2, now=10.0)
    beats.set("a", 3, now=20.0)  # heartbeat: a now lives until 50
    assert beats.items(now=35.0) == [("b", 2), ("a", 3)]
    assert beats.pop_expired(now=45.0) == ["b"]
    assert beats.items(now=45.0) == [("a", 3)]
    assert beats.pop_expired(now=45.0) == []
    assert beats.pop_expired(now=50.0) == ["a"]
    assert len(beats) == 0


# (id, sets as (key, value, now), now, expected live items, expected popped keys)
EXPIRY_CASES = [
    ("nothing stored", [], 0.0, [], []),
    ("all live", [("a", 1, 0.0), ("b", 2, 5.0)], 9.0, [("a", 1), ("b", 2)], []),
    ("oldest expires first", [("a", 1, 0.0), ("b", 2, 5.0)], 10.0, [("b", 2)], ["a"]),
    ("all expired, oldest first", [("a", 1, 0.0), ("b", 2, 5.0), ("c", 3, 6.0)], 99.0, [], ["a", "b", "c"]),
]


@pytest.mark.parametrize("sets, now, live, popped",
                         [case[1:] for case in EXPIRY_CASES], ids=[case[0] for case in EXPIRY_CASES])
def test_expiring_dict_items_and_pop_expired(sets, now, live, popped):
    beats = ExpiringDict(ttl_s=10.0)
    for key, value, at in sets:
        beats.set(key, value, now=at)
    assert beats.items(now=now) == live
    assert beats.pop_expired(now=now) == popped
    assert len(beats) == len(live)


def test_expiring_dict_pop_and_contains():
    beats = ExpiringDict(ttl_s=3600.0)
    beats.set("a", 1)  # monotonic clock: live for an hour
    assert "a" in beats and "b" not in beats
    assert beats.pop("a") == 1
    assert beats.pop("a", "none") == "none"
    assert "a" not in beats


def test_expiring_dict_rejects_empty_ttl():
    with pytest.raises(ValueError):
        ExpiringDict(ttl_s=0.0)
