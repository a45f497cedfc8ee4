"""How often nodes heartbeat, and when a silent node counts as gone, as the network grows (ADR-0037).

Every heartbeat costs the tracker a signature check, a store read and a JSON answer, so the
total rate ``nodes / interval_s`` must stay within what one tracker process serves. The rule,
a pure function of the node count and the configured values:

1. ``interval_s = max(configured, nodes / TARGET_HEARTBEATS_PER_S)``: the budget.
2. But not longer than ``MAX_DROPOUT_S / TIMEOUT_FACTOR`` (12 s), so that a node is found gone
   within 30 s, as long as the rate that needs stays under ``MAX_HEARTBEATS_PER_S``: from 2,400
   to 6,000 nodes the tracker spends more than its budget to keep the 30 s.
3. ``interval_s >= nodes / MAX_HEARTBEATS_PER_S`` always: beyond 6,000 nodes the 30 s no longer
   holds and the timeout grows with the interval (10,000 nodes: 20 s and 50 s).
4. ``timeout_s = max(configured timeout, TIMEOUT_FACTOR * interval_s)``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: total heartbeats per second the tracker aims to serve (about a fifth of what one process
#: served when it saturated at 1,000/s: 10,000 nodes every 10 s, measured 2026-11-30)
TARGET_HEARTBEATS_PER_S = 200.0
#: heartbeats per second the tracker accepts at most to keep dropout detection within MAX_DROPOUT_S:
#: half of where it saturates (bench/heartbeats.py, 10,000 nodes, 2026-11-30: 500/s answered in
#: p50 2 ms / p99 96 ms; 1,000/s in p50 0.64 s / p99 2.3 s)
MAX_HEARTBEATS_PER_S = 500.0
#: a node is gone after this many announced intervals without a heartbeat (two lost heartbeats
#: and a half for jitter and a slow answer)
TIMEOUT_FACTOR = 2.5
#: longest dropout detection the rule keeps while MAX_HEARTBEATS_PER_S allows, seconds
MAX_DROPOUT_S = 30.0


@dataclass(frozen=True)
class Cadence:
    """The heartbeat interval announced to nodes and the dropout timeout, seconds."""

    interval_s: float
    timeout_s: float


def heartbeat_cadence(nodes: int, interval_s: float, timeout_s: float, *,
                      target_per_s: float = TARGET_HEARTBEATS_PER_S,
                      max_per_s: float = MAX_HEARTBEATS_PER_S) -> Cadence:
    """The cadence for a network of ``nodes`` registered nodes.

    Args:
        nodes: registered nodes (>= 0).
        interval_s: the configured heartbeat interval (the shortest ever announced), seconds.
        timeout_s: the configured dropout timeout (the shortest ever used), seconds.
        target_per_s: heartbeat budget, per second; ``max_per_s``: the most spent to keep
            :data:`MAX_DROPOUT_S`, per second (>= ``target_per_s``).

    Returns:
        :class:`Cadence`; with ``nodes <= target_per_s * interval_s`` the configured values.
    """
    budget_s = nodes / target_per_s
    keep_dropout_s = MAX_DROPOUT_S / TIMEOUT_FACTOR
    interval = max(interval_s, min(budget_s, max(keep_dropout_s, interval_s)), nodes / max_per_s)
    return Cadence(interval, max(timeout_s, TIMEOUT_FACTOR * interval))
