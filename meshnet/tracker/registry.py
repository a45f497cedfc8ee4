"""Node registry: the records the tracker keeps per node and per shard.

The payloads they are built from are :mod:`meshnet.protocol.control` models. Records are
plain dataclasses owned by :class:`meshnet.tracker.service.TrackerService`. Trackers that share
one database share the records as JSON (:func:`record_to_json`, :func:`record_from_json`, ADR-0043).
"""

from __future__ import annotations

import json
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

    def to_payload(self) -> ShardInfo:
        """The shard as a node reports it (inverse of :meth:`from_payload`)."""
        start, end = self.layers.to_inclusive()
        return ShardInfo(model=self.model, shard_start=start, shard_end=end, tier=self.tier,
                         quantization=self.quantization, entry=self.entry, weight_bytes=self.weight_bytes,
                         report=self.report)


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
    #: unix time the shared parts of this record last changed (trackers of one database keep the newest, ADR-0043)
    record_at: float = field(default_factory=time.time)
    #: the signed time (unix seconds, the node's own clock) of the latest registration or heartbeat
    #: applied: an older call, one that waited in a frozen tracker after the node moved on, is
    #: refused (ADR-0054; 0 when unknown)
    sent_at: float = 0.0
    #: the relay the node's endpoint goes through (ADR-0045), None when reached directly
    relay_url: str | None = None
    #: the relay tunnel's round trip the node measured at registration, seconds (added to each of its
    #: hops' cost; the latest heartbeat's ``stats.relay_rtt_s`` supersedes it once measured)
    relay_rtt_s: float = 0.0
    #: set while a spot-check's outvote keeps the node out of routes and placement (ADR-0042;
    #: a :class:`meshnet.tracker.quarantine.Quarantine`)
    quarantine: object | None = None
    #: (model, layers) -> tokens/s of this tracker's latest speed probes of that shard, newest last
    #: (at most :data:`meshnet.tracker.speed.PROBE_SAMPLES`; ADR-0068), and when it was last probed
    #: (monotonic seconds): this tracker's own, never shared
    speed_probes: dict = field(default_factory=dict)
    speed_probed_at: dict = field(default_factory=dict)
    #: (model, layers) -> the tokens/s routes count for a shard whose claim this tracker's probes
    #: refuted (ADR-0068); placement counts the node at the lowest of them (:attr:`speed_cap`)
    claims_refuted: dict = field(default_factory=dict)

    @property
    def speed_cap(self) -> float | None:
        """The most tokens/s placement may count for this node: the lowest figure routes count for a
        shard whose claim was refuted (None: no claim refuted, the claim stands)."""
        return min(self.claims_refuted.values()) if self.claims_refuted else None

    def probed_tokens_per_s(self, shard: ShardRecord) -> float | None:
        """The best of this tracker's recent speed probes of ``shard`` (None: not probed)."""
        samples = self.speed_probes.get((shard.model, shard.layers))
        return max(samples) if samples else None

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


#: the fields trackers of one database share; the rest (last failure, last move, the time of the
#: last heartbeat, which travels apart) stays with each tracker
_SHARED = ("node_id", "endpoint", "wallet", "vram_bytes", "ram_bytes", "device", "quantizations",
           "benchmark_tokens_per_sec", "benchmark_model", "max_loaded_shards", "accepts_placement", "registered_at",
           "draining", "reachable", "reach_error", "interval_s", "record_at", "relay_url", "relay_rtt_s", "sent_at")


def record_to_json(node: NodeRecord) -> str:
    """The shared parts of ``node`` as JSON text (ADR-0043): registration fields, shards with their
    capability reports, stats, reports made stale by a reload, drain and reachability."""
    data = {name: getattr(node, name) for name in _SHARED}
    data["shards"] = [s.to_payload().model_dump(mode="json") for s in node.shards]
    data["stats"] = node.stats.model_dump(mode="json")
    data["stale_reports"] = sorted(node.stale_reports)
    return json.dumps(data, separators=(",", ":"))


def record_from_json(text: str, last_heartbeat_s: float) -> NodeRecord:
    """The record :func:`record_to_json` wrote, last heard of at monotonic time ``last_heartbeat_s``.

    Raises:
        ValueError: not such a record (pydantic's ValidationError is one).
    """
    data = json.loads(text)
    shards = [ShardRecord.from_payload(ShardInfo.model_validate(s)) for s in data.pop("shards")]
    stats = NodeStats.model_validate(data.pop("stats"))
    stale = set(data.pop("stale_reports"))
    return NodeRecord(**{name: data[name] for name in _SHARED if name in data}, shards=shards, stats=stats, stale_reports=stale,
                      last_heartbeat_s=last_heartbeat_s, probed_s=time.monotonic())


@dataclass
class ModelInfo:
    """A model the tracker knows: its name, layer count, bytes per layer by recipe (from its
    preset, or ``{"bfloat16": 1}`` for a model only nodes reported) and hub repository."""

    name: str
    num_layers: int
    bytes_per_layer: dict[str, int] = field(default_factory=dict)
    hf_repo: str = ""
