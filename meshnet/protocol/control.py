"""The control plane between nodes and the tracker: registration, heartbeats, directives.

Every payload that crosses the node ↔ tracker boundary is one of these pydantic models, used
on both ends: the sender builds the model and sends ``model_dump(mode="json")``, the receiver
validates the body into the same model. Unknown fields are refused (``extra="forbid"``), so
a field renamed on one side fails loudly (a 422 naming it) instead of silently reading a
default. Layer ranges are inclusive ``shard_start``/``shard_end`` here (ADR-0002); inside
meshnet they are :class:`meshnet.layers.LayerRange`.

Vocabulary defined once for every service: :data:`TIERS`, :data:`RECIPES`,
:data:`DIRECTIVE_TYPES`, :data:`DIRECTIVE_STATUSES`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from meshnet.endpoints import check_endpoint
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange, check_inclusive_end

#: assignment tiers (ADR-0026): ``pinned`` (operator), ``bootstrap`` (first join), ``managed`` (demand)
TIERS = ("pinned", "bootstrap", "managed")
Tier = Literal["pinned", "bootstrap", "managed"]
#: how a shard's weights are held (the recipe's quantization); float32 for exactness runs
RECIPES = ("bfloat16", "int8", "int4", "nf4", "float32")
Recipe = Literal["bfloat16", "int8", "int4", "nf4", "float32"]
#: tracker → node instructions (DESIGN.md, glossary)
DIRECTIVE_TYPES = ("LOAD_SHARD", "DROP_SHARD", "RUN_DOCTOR", "RELOAD")
DirectiveType = Literal["LOAD_SHARD", "DROP_SHARD", "RUN_DOCTOR", "RELOAD"]
#: directive lifecycle: queued → delivered → acked → done | failed
DIRECTIVE_STATUSES = ("queued", "delivered", "acked", "done", "failed")
DirectiveStatus = Literal["queued", "delivered", "acked", "done", "failed"]
#: statuses of a directive not finished yet
OPEN_STATUSES = ("queued", "delivered", "acked")
#: registration default when a node reports no memory: 8 GiB (older nodes keep working)
DEFAULT_VRAM_BYTES = 8 * 1024**3
#: most decoder layers a reported model may have: the deepest published decoder stacks have
#: under 200; the tracker does per-layer work (coverage maps) for a model a node reports
MAX_LAYERS = 1024
#: revision of the node ↔ tracker protocol; a registration states it and a tracker refuses another
#: (426). Revision 1 had no field for it (a registration without ``protocol`` is revision 1);
#: revision 2 adds node keys and signed node calls (ADR-0035); revision 3 session tickets on hop
#: calls (ADR-0038: a revision-2 entry sends none, so its hops would refuse it) and the heartbeat
#: interval in heartbeat responses (ADR-0037: a revision-2 node would refuse the unknown field);
#: revision 4 the ``unverified`` hops of a route (a revision-3 node would refuse the unknown field),
#: witness routes (``like``) and quarantine reports (ADR-0042); revision 5 signs a relay tunnel's
#: attach over the relay's host (ADR-0045: a revision-4 node's attach would be refused); revision 6
#: asks hops for step receipts in a chain's OPEN and judges audits by the accused's signed steps
#: (ADR-0067: a revision-5 hop would refuse the OPEN's unknown field, and a revision-5 entry's
#: distance reports no longer quarantine anyone); revision 7 signs the layers a step ran in its receipt
#: ("meshnet-receipt/2", ADR-0067 third amendment: a revision-6 node's receipts no longer verify);
#: revision 8 signs the model too ("meshnet-receipt/3", ADR-0067 fourth amendment).
PROTOCOL_REVISION = 8

#: a ticket longer than this is refused unread (a route has a few hops; this leaves room for ~60)
MAX_TICKET_CHARS = 8192


class Payload(BaseModel):
    """Base of every control-plane payload: unknown fields and non-finite numbers are validation
    errors (one node's malformed report must not break routing for everyone)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ShardRange(Payload):
    """An inclusive layer range of one model (ADR-0002)."""

    model: str = Field(min_length=1)
    shard_start: int = Field(ge=0, lt=MAX_LAYERS)
    shard_end: int = Field(ge=0, lt=MAX_LAYERS)

    @field_validator("shard_end")
    @classmethod
    def _order(cls, value: int, info: ValidationInfo) -> int:
        return check_inclusive_end(info.data.get("shard_start", 0), value, "shard_start", "shard_end")

    @property
    def layers(self) -> LayerRange:
        """The half-open internal range."""
        return LayerRange.from_inclusive(self.shard_start, self.shard_end)


class RecipeInfo(Payload):
    """How a shard is run: weights' quantization and the compute dtype."""

    quantization: Recipe
    compute_dtype: Literal["float32", "bfloat16", "float16"]


class HardwareInfo(Payload):
    """What a node runs on. Memory in bytes; ``vram_bytes`` is 0 without an accelerator."""

    device: str = "cpu"
    ram_bytes: int = Field(default=0, ge=0)
    vram_bytes: int = Field(default=0, ge=0)
    cpu_count: int = Field(default=1, ge=1)
    platform: str = ""


class CapabilityReport(ShardRange):
    """Result of ``doctor`` on one shard: a real forward pass checked and measured.

    ``tokens_per_s`` is decode throughput through the whole shard; ``timestamp`` unix seconds
    on the node's clock (compared only with itself). Quantized recipes also carry the relative
    error against float32 and the tolerance it was held to. ``resident_bytes`` is the shard's
    measured memory on the node (RSS across its load and a warm-up forward, ADR-0039); absent
    from nodes that do not measure it. The tracker budgets a node's layers of this model with it
    where it exceeds the preset's ``bytes_per_layer``.
    """

    recipe: RecipeInfo
    hardware: HardwareInfo
    weights_digest: str = ""
    tokens_per_s: float = Field(default=0.0, ge=0)
    passed: bool
    reason: str = ""
    timestamp: float
    reference_rel_error: float | None = None
    tolerance: float | None = None
    resident_bytes: int | None = Field(default=None, ge=0)


class ShardInfo(ShardRange):
    """A shard a node holds, as it reports it in registration and heartbeats."""

    tier: Tier = "pinned"
    quantization: Recipe = "bfloat16"
    entry: bool = False
    weight_bytes: int = Field(default=0, ge=0)
    num_layers: int | None = Field(default=None, ge=1, le=MAX_LAYERS)
    report: CapabilityReport | None = None

    @field_validator("num_layers")
    @classmethod
    def _holds_the_shard(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("shard_end", 0) >= value:
            raise ValueError(f"a model of {value} layers has no layer {info.data.get('shard_end')}")
        return value


class NodeStats(Payload):
    """What a node measures and reports in every heartbeat (ADR-0013).

    Attributes:
        tokens_per_s: decode throughput EMA of the node's layers, tokens/s.
        decode_latency_s: EMA of one single-token forward call on this node, seconds.
        requests_per_min: sessions started here per minute (requests passing through).
        sessions: live KV-cache sessions: requests currently running through the node (the
            load routing counts, ADR-0004).
        requests_running: generations this node drives as their entry node, now.
        requests_total: generations driven as entry since start.
        cache_bytes_left: KV-cache space left under the node's cap, bytes.
        tokens_processed: tokens run through this node's layers since start.
        rss_bytes: resident memory of the node process, bytes.
        relay_rtt_s: the relay tunnel's latest keepalive round trip, seconds (0: not relayed, or not
            measured yet; ADR-0045): what each hop through this node pays on top.
    """

    tokens_per_s: float = Field(default=0.0, ge=0)
    decode_latency_s: float = Field(default=0.0, ge=0)
    requests_per_min: float = Field(default=0.0, ge=0)
    sessions: int = Field(default=0, ge=0)
    requests_running: int = Field(default=0, ge=0)
    requests_total: int = Field(default=0, ge=0)
    cache_bytes_left: int = Field(default=0, ge=0)
    tokens_processed: int = Field(default=0, ge=0)
    rss_bytes: int = Field(default=0, ge=0)
    relay_rtt_s: float = Field(default=0.0, ge=0, le=60)


class RegisterRequest(Payload):
    """Body of ``POST /v1/nodes/register`` (DESIGN.md, Control loop).

    ``vram_bytes`` is the node's raw memory (``--memory``, else accelerator memory, else RAM);
    the tracker's placement budgets 80 % of it (ADR-0003). ``protocol`` is the sender's
    :data:`PROTOCOL_REVISION`; ``public_key`` the node's Ed25519 key (base64url of 32 raw bytes,
    :mod:`meshnet.protocol.signing`), bound to ``node_id`` at its first registration (ADR-0035).
    """

    protocol: int = Field(ge=1)
    node_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    public_key: str = Field(pattern=r"^[A-Za-z0-9_-]{43}$")
    wallet: str = ""
    endpoint: str = Field(min_length=1, pattern=r"^https?://")
    vram_bytes: int = Field(default=DEFAULT_VRAM_BYTES, gt=0)
    ram_bytes: int = Field(default=0, ge=0)
    device: str = "cpu"
    quantizations: list[Recipe] = Field(default_factory=lambda: ["bfloat16"], min_length=1)
    benchmark_tokens_per_sec: float = Field(default=0.0, ge=0)
    benchmark_model: str | None = None
    max_loaded_shards: int = Field(default=1, ge=1, le=64)
    accepts_placement: bool = True
    shards: list[ShardInfo] = Field(default_factory=list)
    #: the relay's base URL when ``endpoint`` goes through one (ADR-0045), else None
    relay_url: str | None = Field(default=None, pattern=r"^https?://")
    #: the relay tunnel's measured round trip, seconds: what each relayed hop adds (route cost)
    relay_rtt_s: float = Field(default=0.0, ge=0, le=60)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        try:
            return check_endpoint(value)
        except InvalidRequest as exc:
            raise ValueError(exc.message + " (an IPv6 address goes in brackets: http://[::1]:8821)") from None


def check_revision(data: object) -> None:
    """Refuse a registration body of another protocol revision, before validating its fields (a
    node of another revision may send another shape, and the revision is the error to report).

    Raises:
        InvalidRequest (426 ``protocol_mismatch``): ``protocol`` absent (revision 1) or not
            :data:`PROTOCOL_REVISION`; the message names both revisions.
    """
    if not isinstance(data, dict):
        return  # validation reports the shape
    theirs = data.get("protocol", 1)
    if theirs != PROTOCOL_REVISION:
        raise InvalidRequest(f"node speaks protocol revision {theirs}, this tracker speaks revision "
                           f"{PROTOCOL_REVISION}", code="protocol_mismatch", status=426,
                           hint="run the same meshnet version on the node and the tracker")


class Reachability(Payload):
    """Whether the tracker could reach the node's endpoint (its shards are admitted only if so)."""

    reachable: bool = True
    reach_error: str = ""


class RegisterResponse(Reachability):
    """Answer to a registration: the node's id, the heartbeat period to use (seconds), and the
    tracker's public key (base64url of 32 raw bytes), which signs the session tickets the node
    must see on hop calls (ADR-0038)."""

    node_id: str
    heartbeat_interval_s: float
    tracker_key: str = Field(pattern=r"^[A-Za-z0-9_-]{43}$")


class Directive(Payload):
    """One tracker → node instruction with its lifecycle (times: unix seconds)."""

    id: int
    node_id: str
    type: DirectiveType
    model: str | None = None
    shard_start: int | None = None
    shard_end: int | None = None
    tier: Tier | None = None
    status: DirectiveStatus = "queued"
    error: str | None = None
    reason: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0

    @property
    def layers(self) -> LayerRange | None:
        """The half-open range a shard directive names (None for RUN_DOCTOR / RELOAD)."""
        if self.shard_start is None or self.shard_end is None:
            return None
        return LayerRange.from_inclusive(self.shard_start, self.shard_end)


class DirectiveList(Payload):
    """Body of ``GET /v1/directives``: newest first."""

    directives: list[Directive]


class DirectiveUpdate(Payload):
    """A node's progress on one directive, carried by its next heartbeat."""

    id: int
    status: Literal["acked", "done", "failed"]
    error: str | None = None


class HeartbeatRequest(Payload):
    """Body of ``POST /v1/nodes/{id}/heartbeat``."""

    shards: list[ShardInfo] = Field(default_factory=list)
    stats: NodeStats = Field(default_factory=NodeStats)
    directive_updates: list[DirectiveUpdate] = Field(default_factory=list)


class HeartbeatResponse(Reachability):
    """The directives delivered by this heartbeat, in the order to apply them, and the heartbeat
    interval the node is to use from now on, seconds (None: unchanged). The tracker lengthens it
    as the network grows so its total heartbeat rate stays within a budget (ADR-0037)."""

    directives: list[Directive] = Field(default_factory=list)
    heartbeat_interval_s: float | None = Field(default=None, gt=0)


class FailureReport(Payload):
    """Body of ``POST /v1/nodes/{id}/failure``: why a hop failed, and the session ticket whose
    route named the hop (the tracker counts a report only from the entry it issued that ticket to)."""

    reason: str = Field(default="", max_length=2000)
    ticket: str = Field(default="", max_length=MAX_TICKET_CHARS)


class QuarantineReport(ShardRange):
    """Body of ``POST /v1/nodes/{id}/quarantine``: an entry node's spot-check found the node
    outvoted over ``shard_start``..``shard_end`` of ``model`` (ADR-0042). ``witnesses`` are the
    two other holders that ran the same input; ``distances`` the pairwise relative L2 distances
    of the three outputs, keyed ``"a|b"`` by node ids; ``tolerance`` the agreement threshold the
    entry used."""

    witnesses: list[str] = Field(min_length=2, max_length=2)
    distances: dict[str, float] = Field(max_length=3)
    tolerance: float = Field(ge=0)
    session: str = Field(default="", max_length=128)
    ticket: str = Field(default="", max_length=MAX_TICKET_CHARS)  # the ticket whose route named the accused


#: most steps an audit's evidence carries (a decode audit cut at the worst step of a long session)
MAX_AUDIT_STEPS = 4096


class AuditStep(Payload):
    """One step of an audited hop (ADR-0067): ``tokens`` positions from ``position``, the message
    ``flags``, the frame the hop received (``input``) and sent (``output``; None: nothing), as
    base64url, and the hop's signed ``receipt`` of them (128 bytes, base64url)."""

    position: int = Field(ge=0, lt=2**32)
    tokens: int = Field(ge=1, le=65536)
    flags: int = Field(ge=0, le=255)
    input: str = Field(min_length=1)
    output: str | None = None
    receipt: str = Field(min_length=1, max_length=256)


class AuditReplay(Payload):
    """The entry's own witness's run of the disputed steps' inputs (ADR-0067, amended 2026-12-07):
    ``witness`` ran them as fresh session ``session`` (32 hex), chunked, every position returned;
    ``steps`` are its calls in order, each with the witness's signed receipt. With it the tracker
    can tell a false accusation from a witness that lied to the entry."""

    witness: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    session: str = Field(pattern=r"^[0-9a-f]{32}$")
    steps: list[AuditStep] = Field(min_length=1, max_length=MAX_AUDIT_STEPS)


class AuditReport(ShardRange):
    """Body of ``POST /v1/nodes/{id}/audit``: an entry's audit found the node's outputs away from a
    second holder's over ``shard_start``..``shard_end`` of ``model`` (ADR-0067). The evidence is
    the node's own: every step of chain ``chain_id`` from position 0 up to the disputed one, with
    the node's signed receipts; ``ticket`` is the session ticket whose route named it; ``replay``
    (optional) the signed run of the entry's witness that the entry measured against. The
    tracker re-runs the inputs on holders it picks and decides."""

    chain_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    ticket: str = Field(min_length=1, max_length=MAX_TICKET_CHARS)
    steps: list[AuditStep] = Field(min_length=1, max_length=MAX_AUDIT_STEPS)
    replay: AuditReplay | None = None


class DoctorResponse(Payload):
    """Body of a node's ``POST /v1/doctor``: one capability report per loaded shard."""

    reports: list[CapabilityReport]


class AssignResponse(Payload):
    """Answer of ``GET /v1/network/assign`` (ADR-0011): the range a joining node should take."""

    hf_repo: str
    model: str
    shard_start: int
    shard_end: int
    num_layers: int
    gap_found: bool
    price_per_token: float = 0.0
