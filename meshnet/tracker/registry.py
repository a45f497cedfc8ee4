"""Node registry: validated registration/heartbeat payloads and the records kept per node.

Payloads are pydantic models, so a bad field is a 422 naming it. Records are plain
dataclasses owned by :class:`meshnet.tracker.service.TrackerService`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from meshnet.endpoints import check_endpoint
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

#: registration default when a node reports no memory: 8 GiB of bfloat16 (older nodes keep working)
DEFAULT_VRAM_BYTES = 8 * 1024**3
RECIPES = ("bfloat16", "int8", "nf4", "float32")


class ShardPayload(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    shard_start: int = Field(ge=0)
    shard_end: int = Field(ge=0)
    tier: str = "pinned"
    quantization: str = "bfloat16"
    entry: bool = False
    weight_bytes: int = Field(default=0, ge=0)
    num_layers: int | None = Field(default=None, ge=1)
    report: dict | None = None

    @field_validator("shard_end")
    @classmethod
    def _order(cls, value: int, info: ValidationInfo) -> int:
        if value < info.data.get("shard_start", 0):
            raise ValueError("shard_end must be >= shard_start (inclusive range)")
        return value


class RegisterPayload(BaseModel):
    """Capability payload of ``POST /v1/nodes/register`` (DESIGN.md, Control loop)."""

    model_config = ConfigDict(extra="ignore")
    node_id: str | None = Field(default=None, min_length=1, max_length=128)
    wallet: str = ""
    endpoint: str = Field(min_length=1, pattern=r"^https?://")
    vram_bytes: int = Field(default=DEFAULT_VRAM_BYTES, gt=0)
    ram_bytes: int = Field(default=0, ge=0)
    device: str = "cpu"
    quantizations: list[str] = Field(default_factory=lambda: ["bfloat16"], min_length=1)
    benchmark_tokens_per_sec: float = Field(default=0.0, ge=0)
    benchmark_model: str | None = None
    max_loaded_shards: int = Field(default=1, ge=1, le=64)
    accepts_placement: bool = True
    shards: list[ShardPayload] = Field(default_factory=list)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        try:
            return check_endpoint(value)
        except InvalidRequest as exc:
            raise ValueError(exc.message + " (an IPv6 address goes in brackets: http://[::1]:8821)") from None

    @field_validator("quantizations")
    @classmethod
    def _recipes(cls, value: list[str]) -> list[str]:
        bad = [q for q in value if q not in RECIPES]
        if bad:
            raise ValueError(f"unknown recipe {bad[0]!r} (known: {', '.join(RECIPES)})")
        return value


class FailureReport(BaseModel):
    """Body of ``POST /v1/nodes/{id}/failure``: why a hop failed."""

    reason: str = Field(default="", max_length=2000)


class DirectiveUpdate(BaseModel):
    id: int
    status: str = Field(pattern="^(acked|done|failed)$")
    error: str | None = None


class HeartbeatPayload(BaseModel):
    model_config = ConfigDict(extra="ignore")
    shards: list[ShardPayload] = Field(default_factory=list)
    stats: dict = Field(default_factory=dict)
    directive_updates: list[DirectiveUpdate] = Field(default_factory=list)


@dataclass
class ShardRecord:
    """One shard a node reports as loaded and serving."""

    model: str
    layers: LayerRange
    tier: str
    quantization: str
    entry: bool
    weight_bytes: int
    report: dict | None

    @classmethod
    def from_payload(cls, p: ShardPayload) -> "ShardRecord":
        return cls(p.model, LayerRange.from_inclusive(p.shard_start, p.shard_end), p.tier, p.quantization,
                   p.entry, p.weight_bytes, p.report)


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
    stats: dict = field(default_factory=dict)
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

    @property
    def quantization(self) -> str:
        return self.quantizations[0]

    def admitted(self, shard: ShardRecord) -> bool:
        """A shard counts (coverage, routes) only with a present, passed and fresh report, on a
        node the tracker can reach."""
        report = shard.report
        return bool(report and report.get("passed") and not self.is_stale(report) and not self.draining
                    and self.reachable)

    def is_stale(self, report: dict | None) -> bool:
        return bool(report) and report.get("timestamp") in self.stale_reports

    def mark_reports_stale(self) -> None:
        """A reload: every current report stays out of coverage until a new doctor replaces it."""
        self.stale_reports.update(s.report.get("timestamp") for s in self.shards if s.report)

    def tokens_per_s(self, shard: ShardRecord) -> float:
        """Best known throughput of ``shard``: the EMA from heartbeats, else doctor's figure."""
        measured = float(self.stats.get("tokens_per_s") or 0.0)
        doctor = float((shard.report or {}).get("tokens_per_s") or 0.0)
        return measured or doctor or self.benchmark_tokens_per_sec or 1.0
