"""What the tracker shows operators: coverage maps, typed on both ends (the tracker builds them,
the client validates them). Layer numbers are inclusive here (ADR-0002)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from meshnet.protocol.control import NodeStats


class CoverageSegment(BaseModel):
    """Consecutive layers ``start_layer..end_layer`` served by ``node_count`` admitted shards."""

    model_config = ConfigDict(extra="forbid")
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=0)
    node_count: int = Field(ge=0)


class Coverage(BaseModel):
    """One model's coverage map. ``routable``: every layer covered and an entry node admitted;
    ``demand``: chat requests refused while not routable, per minute."""

    model_config = ConfigDict(extra="forbid")
    model: str
    num_layers: int = Field(ge=1)
    segments: list[CoverageSegment]
    covered_layers: int = Field(ge=0)
    routable: bool
    demand: float = Field(default=0.0, ge=0)


class CoverageList(BaseModel):
    """Body of ``GET /v1/coverage``: every tracked model's coverage map."""

    model_config = ConfigDict(extra="forbid")
    models: list[Coverage]


class CapabilityView(BaseModel):
    """The part of a shard's capability report operators read (None: no report yet)."""

    model_config = ConfigDict(extra="forbid")
    passed: bool | None = None
    reason: str | None = None
    tokens_per_s: float | None = None
    timestamp: float | None = None
    stale: bool = False


class ShardView(BaseModel):
    """A shard a node holds, with its tier and whether it counts (admitted)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    shard_start: int = Field(ge=0)
    shard_end: int = Field(ge=0)
    tier: str
    quantization: str
    entry: bool
    weight_bytes: int = Field(ge=0)
    admitted: bool
    capability: CapabilityView
    #: the tracker's check of the shard (ADR-0042): ``state`` (``pending``, ``verified``,
    #: ``unverified``, ``rejected``) and ``reason``; after a challenge also ``references``,
    #: ``distances`` (``"candidate|reference"`` -> relative L2) and ``tolerance``
    verification: dict | None = None
    #: the best of this tracker's recent timings of the shard's decode step, tokens/s (None: not
    #: timed; ADR-0068), whether its claimed speed is set aside for it in routes, and the tokens/s
    #: routes count for it (its claim, or the timed figure scaled as its peers claim; None: not admitted)
    probed_tokens_per_s: float | None = None
    claim_lost: bool = False
    routed_tokens_per_s: float | None = None


class NodeView(BaseModel):
    """One node as ``GET /v1/nodes`` shows it. Memory in bytes: ``vram_bytes`` as reported,
    ``memory_budget_bytes`` the 80 % placement budgets (ADR-0003); ``max_assignable_layers`` per
    tracked model, at most the model's layers; ``last_heartbeat_age_s`` seconds."""

    model_config = ConfigDict(extra="allow")  # newer trackers may add fields an older client shows as-is
    node_id: str
    endpoint: str
    device: str
    wallet: str
    vram_bytes: int
    memory_budget_bytes: int
    ram_bytes: int
    quantization: str
    max_assignable_layers: dict[str, int]
    slots_used: int
    slots_total: int
    shards: list[ShardView]
    accepts_placement: bool
    draining: bool
    reachable: bool
    reach_error: str
    reason: str
    stats: NodeStats
    last_heartbeat_age_s: float
    benchmark_tokens_per_sec: float
    #: set while the node is quarantined (ADR-0042): ``reported_by``, ``model``,
    #: ``shard_start``/``shard_end``, ``witnesses``, ``distances`` (``"a|b"`` -> relative L2),
    #: ``tolerance``, ``since`` (unix seconds)
    quarantine: dict | None = None
    #: its audit accusations by the tracker's verdict (ADR-0067): ``upheld``, ``false``, ``forged``;
    #: None when it made none
    accusations: dict[str, int] | None = None
    #: the operator trusts it (``meshnet trust``, ADR-0069)
    trusted: bool = False


class NodeList(BaseModel):
    """Body of ``GET /v1/nodes``."""

    model_config = ConfigDict(extra="forbid")
    nodes: list[NodeView]


class DemandRow(BaseModel):
    """A tracked model's queued demand (refused requests per minute) and whether it is routable."""

    model_config = ConfigDict(extra="forbid")
    model: str
    requests_per_min: float = Field(ge=0)
    routable: bool


class DemandList(BaseModel):
    """Body of ``GET /v1/demand``."""

    model_config = ConfigDict(extra="forbid")
    demand: list[DemandRow]
