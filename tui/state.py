"""What the console knows: the last snapshot of the tracker plus bounded histories.

Pure (no textual, no I/O): :class:`ConsoleState.apply` folds one poll's JSON into the
state, given the console clock's ``now``. The views only read from here.

- tokens/s per node: a bounded history (for sparklines) of the node's heartbeat EMA,
  falling back to its best capability report;
- requests per minute per node: the node's own ``requests_per_min`` when its heartbeat
  carries one, else derived from its ``requests_total`` counter over a sliding window;
- directive status trails: each status the console has *seen* a directive in, so the
  log shows ``queued → delivered → done`` transitions;
- traffic (the tracker's ``GET /v1/traffic``, fetched only while the traffic view is shown):
  the last answer, or why it could not be read, and which failovers are new since the last one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tui.connection import Connection

#: samples kept per node for the tokens/s sparkline
HISTORY_LEN = 60
#: window for requests-per-minute, seconds of console clock
RPM_WINDOW_S = 60.0
#: shortest span of samples a rate is computed over (two polls 50 ms apart say nothing)
RPM_MIN_SPAN_S = 5.0
#: failover events remembered as seen (to tell the new ones), far more than a poll brings
SEEN_FAILOVERS = 1000


def failover_key(event: dict) -> tuple:
    """What identifies a failover event across polls."""
    return event["session_id"], event["failed_node"], event["at_s"]


@dataclass(frozen=True)
class Snapshot:
    """One poll of the tracker: the JSON of /v1/nodes, /v1/coverage, /v1/directives, /v1/demand."""

    nodes: tuple[dict, ...] = ()
    coverage: tuple[dict, ...] = ()
    directives: tuple[dict, ...] = ()
    demand: tuple[dict, ...] = ()
    fetched_s: float = 0.0


def node_tokens_per_s(node: dict) -> float | None:
    """Heartbeat EMA of tokens/s, else the best capability report's figure, else None."""
    measured = float((node.get("stats") or {}).get("tokens_per_s") or 0.0)
    if measured:
        return measured
    reports = [float(s["capability"].get("tokens_per_s") or 0.0) for s in node.get("shards", [])
               if s.get("capability")]
    return max(reports, default=0.0) or None


def node_rpm(node: dict, history: "NodeHistory | None") -> float | None:
    """Requests per minute: the node's own figure (heartbeat ``requests_per_min``), else the
    rate of its ``requests_total`` counter across polls."""
    stats = node.get("stats") or {}
    if stats.get("requests_per_min") is not None:
        return float(stats["requests_per_min"])
    return history.rpm() if history else None


def memory_used_bytes(node: dict) -> int:
    """Weight bytes of the shards the node holds (what counts against its memory budget)."""
    return sum(int(s.get("weight_bytes") or 0) for s in node.get("shards", []))


def capability_summary(node: dict, now: float) -> tuple[str, float | None]:
    """``(status, age_s)`` over a node's shards.

    status: ``quarantined`` (a spot-check outvoted it, ADR-0042) | ``draining`` | ``none`` (no shard
    or no report) | ``failed`` | ``stale`` | ``ok``;
    age is that of the oldest report (``now`` is wall-clock seconds, like report timestamps).
    """
    caps = [s.get("capability") or {} for s in node.get("shards", [])]
    stamps = [c["timestamp"] for c in caps if c.get("timestamp")]
    age = now - min(stamps) if stamps else None
    if node.get("quarantine"):
        return "quarantined", age
    if node.get("draining"):
        return "draining", age
    if not caps or any(c.get("passed") is None for c in caps):
        return "none", age
    if any(not c.get("passed") for c in caps):
        return "failed", age
    if any(c.get("stale") for c in caps):
        return "stale", age
    return "ok", age


def node_ranges(node: dict) -> list[tuple[str, int, int, str, bool]]:
    """``(model, shard_start, shard_end, tier, admitted)`` per shard, inclusive like the API."""
    return [(s["model"], s["shard_start"], s["shard_end"], s.get("tier", ""), bool(s.get("admitted")))
            for s in node.get("shards", [])]


@dataclass
class NodeHistory:
    """Bounded per-node samples taken at each successful poll."""

    tokens_per_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY_LEN))
    requests: deque = field(default_factory=lambda: deque(maxlen=HISTORY_LEN))

    def add(self, node: dict, now: float) -> None:
        tps = node_tokens_per_s(node)
        self.tokens_per_s.append(tps or 0.0)
        total = (node.get("stats") or {}).get("requests_total")
        if total is not None:
            self.requests.append((now, int(total)))

    def rpm(self) -> float | None:
        """Requests per minute over the last :data:`RPM_WINDOW_S`; None until samples span
        :data:`RPM_MIN_SPAN_S`."""
        if len(self.requests) < 2:
            return None
        t_now, total_now = self.requests[-1]
        window = [(t, n) for t, n in self.requests if t_now - t <= RPM_WINDOW_S]
        t0, total0 = window[0]
        if t_now - t0 < RPM_MIN_SPAN_S:
            return None
        return max(0, total_now - total0) * 60.0 / (t_now - t0)


@dataclass
class ConsoleState:
    """Everything the views render. ``apply`` and ``record_failure`` are the only writers."""

    connection: Connection = field(default_factory=Connection)
    snapshot: Snapshot | None = None
    histories: dict[str, NodeHistory] = field(default_factory=dict)
    trails: dict[int, list[str]] = field(default_factory=dict)
    polls: int = 0
    #: the tracker's last ``GET /v1/traffic`` answer (None: not fetched yet)
    traffic: dict | None = None
    #: why the last traffic fetch failed (None: it did not)
    traffic_error: str | None = None
    seen_failovers: dict[tuple, None] = field(default_factory=dict)

    def apply(self, snapshot: Snapshot, now: float) -> bool:
        """Fold one successful poll in; returns True if the connection state changed."""
        self.snapshot = snapshot
        self.polls += 1
        live = {n["node_id"] for n in snapshot.nodes}
        for gone in set(self.histories) - live:
            del self.histories[gone]
        for node in snapshot.nodes:
            self.histories.setdefault(node["node_id"], NodeHistory()).add(node, now)
        seen = set()
        for d in snapshot.directives:
            seen.add(d["id"])
            trail = self.trails.setdefault(d["id"], [])
            if not trail or trail[-1] != d["status"]:
                trail.append(d["status"])
        for old in set(self.trails) - seen:
            del self.trails[old]
        return self.connection.record_ok(now)

    def apply_traffic(self, traffic: dict) -> list[dict]:
        """Fold in one traffic answer; returns its failover events not seen before, newest first
        (none on the first answer: what happened before the console looked is history, not news)."""
        first = self.traffic is None
        self.traffic, self.traffic_error = traffic, None
        new = [e for e in traffic.get("failovers", []) if failover_key(e) not in self.seen_failovers]
        for event in reversed(new):
            self.seen_failovers[failover_key(event)] = None
        while len(self.seen_failovers) > SEEN_FAILOVERS:
            del self.seen_failovers[next(iter(self.seen_failovers))]
        return [] if first else new

    def record_traffic_failure(self, error: str) -> None:
        """The traffic fetch failed (the last answer is kept)."""
        self.traffic_error = error

    def record_failure(self, error: str, now: float) -> bool:
        """A poll failed; the snapshot is kept (shown dimmed). True if the state changed."""
        self.polls += 1
        return self.connection.record_failure(error, now)

    # ---- queries ----------------------------------------------------------------------

    @property
    def nodes(self) -> tuple[dict, ...]:
        return self.snapshot.nodes if self.snapshot else ()

    @property
    def coverage(self) -> tuple[dict, ...]:
        return self.snapshot.coverage if self.snapshot else ()

    @property
    def directives(self) -> tuple[dict, ...]:
        return self.snapshot.directives if self.snapshot else ()

    @property
    def demand(self) -> tuple[dict, ...]:
        return self.snapshot.demand if self.snapshot else ()

    def node(self, node_id: str | None) -> dict | None:
        return next((n for n in self.nodes if n["node_id"] == node_id), None)

    def models(self) -> list[str]:
        return [c["model"] for c in self.coverage]

    def num_layers(self, model: str) -> int | None:
        return next((c["num_layers"] for c in self.coverage if c["model"] == model), None)

    def demand_for(self, model: str) -> float:
        return next((float(d.get("requests_per_min") or 0.0) for d in self.demand if d["model"] == model), 0.0)

    def holders(self, model: str) -> list[tuple[str, int, int, str, bool]]:
        """``(node_id, shard_start, shard_end, tier, admitted)`` of every shard of ``model``."""
        out = []
        for node in self.nodes:
            for m, a, b, tier, admitted in node_ranges(node):
                if m == model:
                    out.append((node["node_id"], a, b, tier, admitted))
        return sorted(out, key=lambda h: (h[1], h[0]))
