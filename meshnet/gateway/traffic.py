"""What an entry node is driving now: its sessions in flight and the failovers it made (ADR-0046).

The orchestrator tells a :class:`TrafficLog` when a generation starts and ends and when a hop
is replaced; the log reads the rest (tokens so far, time to first token, the current route)
from the generation's own live objects when asked, so the token path pays one dict insert and
one delete per generation and nothing per token. The node serves it in ``GET /v1/traffic``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from meshnet.protocol.route import Hop
from meshnet.protocol.traffic import FailoverEvent, HopView, SessionInFlight

#: failover events an entry node keeps (newest win); the tracker merges every node's into its own list
MAX_FAILOVERS = 20
#: characters of a failover's reason kept
REASON_CHARS = 240


def hop_view(hop: Hop) -> HopView:
    """A hop as the traffic view shows it (layers inclusive, ADR-0002)."""
    start, end = hop.layers.to_inclusive()
    return HopView(node_id=hop.node_id, start_layer=start, end_layer=end)


@dataclass
class _Live:
    model: str
    started_s: float
    stats: Any  # meshnet.gateway.pipeline.GenerationStats, filled as the generation runs
    route: Callable[[], list[Hop]]  # the route now (failovers change it)


class TrafficLog:
    """Sessions in flight on one entry node and its latest failover events.

    Args:
        node_id: this node, named as the entry of its sessions and events.
        clock: wall-clock seconds (``time.time``); tests pass a fixed one.
        max_failovers: events kept, newest win.
    """

    def __init__(self, node_id: str, *, clock: Callable[[], float] = time.time,
                 max_failovers: int = MAX_FAILOVERS) -> None:
        self.node_id = node_id
        self.clock = clock
        self._live: dict[str, _Live] = {}
        self._failovers: deque[FailoverEvent] = deque(maxlen=max_failovers)

    def __len__(self) -> int:
        """Sessions in flight."""
        return len(self._live)

    def session_started(self, session_id: str, model: str, stats: Any, route: Callable[[], list[Hop]]) -> None:
        """A generation started: ``stats`` (a ``GenerationStats``) is read live for its token
        counts and time to first token; ``route()`` gives its hops now, entry first."""
        self._live[session_id] = _Live(model, self.clock(), stats, route)

    def session_ended(self, session_id: str) -> None:
        """The generation ended, however it ended (unknown ids are ignored)."""
        self._live.pop(session_id, None)

    def failover(self, session_id: str, failed: Hop, replacement: list[Hop], reason: str) -> None:
        """A hop of ``session_id`` was replaced: ``failed`` by ``replacement`` (same layers)."""
        start, end = failed.layers.to_inclusive()
        self._failovers.append(FailoverEvent(
            at_s=self.clock(), session_id=session_id, entry_node=self.node_id, failed_node=failed.node_id,
            start_layer=start, end_layer=end, replacement=[h.node_id for h in replacement],
            reason=" ".join(reason.split())[:REASON_CHARS]))

    def sessions(self) -> list[SessionInFlight]:
        """The sessions in flight now, oldest first."""
        now = self.clock()
        out = []
        for session_id, live in sorted(self._live.items(), key=lambda kv: kv[1].started_s):
            s = live.stats
            out.append(SessionInFlight(
                session_id=session_id, model=live.model, entry_node=self.node_id,
                route=[hop_view(h) for h in live.route()], prompt_tokens=s.prompt_tokens,
                completion_tokens=s.completion_tokens, age_s=round(max(0.0, now - live.started_s), 3),
                ttft_s=None if s.first_token_s is None else round(s.first_token_s, 4),
                failovers=self._failovers_of(session_id)))
        return out

    def _failovers_of(self, session_id: str) -> int:
        return sum(1 for e in self._failovers if e.session_id == session_id)

    def failovers(self) -> list[FailoverEvent]:
        """The latest failover events, newest first."""
        return list(reversed(self._failovers))
