"""The heartbeat cadence rule (ADR-0037): the interval grows with the network within a budget,
the dropout timeout follows it, and 30 s detection holds while the rate allows."""

from __future__ import annotations

import pytest

from meshnet.tracker.cadence import (MAX_DROPOUT_S, MAX_HEARTBEATS_PER_S, TARGET_HEARTBEATS_PER_S, Cadence,
                                     heartbeat_cadence)


@pytest.mark.parametrize(("nodes", "interval_s", "timeout_s", "expected"), [
    (0, 10.0, 25.0, Cadence(10.0, 25.0)),          # empty network: the configured values
    (1_000, 10.0, 25.0, Cadence(10.0, 25.0)),      # 100/s: within the 200/s budget
    (2_000, 10.0, 25.0, Cadence(10.0, 25.0)),      # exactly the budget
    (2_200, 10.0, 25.0, Cadence(11.0, 27.5)),      # the budget lengthens the interval
    (2_400, 10.0, 25.0, Cadence(12.0, 30.0)),      # the longest interval that keeps 30 s
    (4_000, 10.0, 25.0, Cadence(12.0, 30.0)),      # over budget (333/s) to keep 30 s
    (6_000, 10.0, 25.0, Cadence(12.0, 30.0)),      # at the 500/s ceiling
    (10_000, 10.0, 25.0, Cadence(20.0, 50.0)),     # beyond: 30 s no longer holds
    (100_000, 10.0, 25.0, Cadence(200.0, 500.0)),
    (100, 1.0, 3.0, Cadence(1.0, 3.0)),            # a local mesh's short settings stay
    (600, 1.0, 3.0, Cadence(3.0, 7.5)),
    (4_000, 15.0, 40.0, Cadence(15.0, 40.0)),      # a configured interval over 12 s is kept
    (100, 10.0, 60.0, Cadence(10.0, 60.0)),        # a longer configured timeout is kept
])
def test_heartbeat_cadence(nodes, interval_s, timeout_s, expected):
    assert heartbeat_cadence(nodes, interval_s, timeout_s) == expected


@pytest.mark.parametrize("nodes", [1, 10, 500, 2_000, 2_401, 5_000, 6_000, 6_001, 10_000, 50_000])
def test_rate_and_dropout_bounds(nodes):
    c = heartbeat_cadence(nodes, 10.0, 25.0)
    rate = nodes / c.interval_s
    assert rate <= MAX_HEARTBEATS_PER_S + 1e-9
    if nodes <= MAX_HEARTBEATS_PER_S * MAX_DROPOUT_S / 2.5:
        assert c.timeout_s <= MAX_DROPOUT_S
    if rate > TARGET_HEARTBEATS_PER_S + 1e-9:
        assert c.timeout_s == pytest.approx(max(MAX_DROPOUT_S, 2.5 * nodes / MAX_HEARTBEATS_PER_S))
