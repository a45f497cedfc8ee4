"""Node registry: the records the tracker keeps per node and per shard.

The payloads they are built from are :mod:`meshnet.protocol.control` models. Records are
plain dataclasses owned by :class:`meshnet.tracker.service.TrackerService`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshnet.layers import LayerRange
from meshnet.presets import canonical_model_name
from meshnet.protocol.control import CapabilityReport, NodeStats, ShardInfo
from meshnet.tracker.admission import ADMITTING


@dataclass
class ShardRecord:
    """One shard a node reports as loaded and serving."""

    model: str
    layers: LayerRange
    tier: str
    quantization: str
    entry: bool
    weight_bytes: int
    report: CapabilityReport | None
    #: the tracker's verification of this report (:class:`meshnet.tracker.admission.Verdict`;
    #: None: not decided yet, e.g. the node is not reachable yet), ADR-0042
    verdict: object | None = None

    @classmethod
    def from_payload(cls, p: ShardInfo) -> "ShardRecord":
        """The record of a reported shard, under the model's one canonical name (aliases resolved)."""
        return cls(canonical_model_name(p.model), p.layers, p.tier, p.quantization, p.entry, p.weight_bytes,
                   p.report)


@dataclass
class NodeRecord:
    """What the tracker knows of one node."""

    node_id: str
    endpoint: str
    wallet: str
    vram_bytes: int
    ram_bytes: int
    device: str
    quantizations: list[str]
    benchmark_tokens_per_sec: float
    benchmark_model: str | None
    max_loaded_shards: int
    accepts_placement: bool
    shards: list[ShardRecord] = field(default_factory=list)
    stats: NodeStats = field(default_factory=NodeStats)
    last_heartbeat_s: float = field(default_factory=time.monotonic)
    registered_at: float = field(default_factory=time.time)
    last_failure_s: float | None = None
    #: reports (by their node-side timestamp) made stale by a reload: the node's clock is never
    #: compared with the tracker's, so clock skew cannot make a stale report look fresh
    stale_reports: set = field(default_factory=set)
    draining: bool = False
    last_move_s: float | None = None   # monotonic time of the last demand move (cooldown, ADR-0005)
    reason: str = ""            # why the node did or did not receive a range (placement)
    #: the tracker connected to ``endpoint`` (meshnet.tracker.probe); until then nothing is admitted
    reachable: bool = False
    reach_error: str = "not probed yet"
    probed_s: float | None = None  # monotonic time of the last probe's answer
    #: the heartbeat interval last announced to this node, seconds (its dropout timeout follows it, ADR-0037)
    interval_s: float = 0.0
    #: set while a spot-check's outvote keeps the node out of routes and placement (ADR-0042;
    #: a :class:`meshnet.tracker.quarantine.Quarantine`)
    quarantine: object | None = None

    @property
    def quantization(self) -> str:
        return self.quantizations[0]

    def admitted(self, shard: ShardRecord) -> bool:
        """A shard counts (coverage, routes) only with a present, passed and fresh report that the
        tracker verified (or admitted unverified, ADR-0042), on a node the tracker can reach that is
        not quarantined."""
        report = shard.report
        return bool(report is not None and report.passed and not self.is_stale(report) and not self.draining
                    and self.reachable and self.quarantine is None
                    and shard.verdict is not None and shard.verdict.state in ADMITTING)

    def is_stale(self, report: CapabilityReport | None) -> bool:
        return report is not None and report.timestamp in self.stale_reports

    def mark_reports_stale(self) -> None:
        """A reload: every current report stays out of coverage until a new doctor replaces it."""
        self.stale_reports.update(s.report.timestamp for s in self.shards if s.report is not None)

    def tokens_per_s(self, shard: ShardRecord) -> float:
        """Best known throughput of ``shard``: the EMA from heartbeats, else doctor's figure."""
        measured = self.stats.tokens_per_s
        doctor = shard.report.tokens_per_s if shard.report is not None else 0.0
        return measured or doctor or self.benchmark_tokens_per_sec or 1.0
