"""What the data plane looks like right now: sessions in flight, recent failovers, and a short
history of time to first token, time per output token, tokens and batch sizes (ADR-0046).

A node answers ``GET /v1/traffic`` with a :class:`NodeTraffic`; the tracker answers its own
``GET /v1/traffic`` with a :class:`MeshTraffic` gathering every registered node's. Times are
wall-clock seconds since the epoch (``at_s``, ``start_s``), ages and latencies are seconds,
layer numbers are inclusive (ADR-0002).
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field

#: seconds covered by one history bucket
BUCKET_S = 10.0
#: buckets in a history (10 minutes)
BUCKET_COUNT = 60


class HopView(BaseModel):
    """One hop of a session's route: a node and the layers it runs for the session (inclusive)."""

    model_config = ConfigDict(extra="forbid")
    node_id: str
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=0)


class SessionInFlight(BaseModel):
    """A generation its entry node is driving now.

    ``age_s``: seconds since it started; ``ttft_s``: seconds from the request's arrival to its
    first token (None: none yet); ``failovers``: hops replaced so far.
    """

    model_config = ConfigDict(extra="forbid")
    session_id: str
    model: str
    entry_node: str
    route: list[HopView]
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    age_s: float = Field(ge=0)
    ttft_s: float | None = None
    failovers: int = Field(default=0, ge=0)


class FailoverEvent(BaseModel):
    """A hop replaced mid-session: at ``at_s`` (epoch seconds) the entry node ``entry_node``
    replaced ``failed_node`` on layers ``start_layer..end_layer`` by ``replacement`` (node ids,
    in layer order); ``reason`` is the hop's error, one line."""

    model_config = ConfigDict(extra="forbid")
    at_s: float
    session_id: str
    entry_node: str
    failed_node: str
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=0)
    replacement: list[str]
    reason: str = ""


class TrafficBucket(BaseModel):
    """``bucket_s`` seconds of one node's traffic starting at ``start_s`` (epoch seconds, a
    multiple of ``bucket_s``). A mean is None when nothing was observed in the bucket.

    - ``ttft_s``: mean time to first token of the generations whose first token fell here;
      ``first_tokens``: how many.
    - ``tpot_s``: mean time per output token of the generations that finished here; ``finished``:
      how many (those with at least two tokens).
    - ``forward_tokens``: tokens run through this node's layers (prefill and decode, all sessions).
    - ``batch_size``: mean sessions per forward; ``batch_size_max``: the largest (0: no forward);
      ``forwards``: how many forwards.
    """

    model_config = ConfigDict(extra="forbid")
    start_s: float
    ttft_s: float | None = None
    first_tokens: int = Field(default=0, ge=0)
    tpot_s: float | None = None
    finished: int = Field(default=0, ge=0)
    forward_tokens: int = Field(default=0, ge=0)
    batch_size: float | None = None
    batch_size_max: int = Field(default=0, ge=0)
    forwards: int = Field(default=0, ge=0)


class NodeTraffic(BaseModel):
    """Body of a node's ``GET /v1/traffic``; in the tracker's answer also whether it answered.

    ``buckets`` run oldest first and end with the bucket holding ``at_s``; ``sessions`` are the
    generations this node drives as entry; ``kv_sessions`` counts the live KV-cache sessions it
    holds (as entry or as a hop of anyone's route); ``failovers`` the latest it saw, newest first.
    ``error``: set by the tracker when it could not read this node (then the lists are empty).
    In the tracker's :class:`MeshTraffic` the sessions and failovers are in its mesh-wide lists
    and left empty here.
    """

    model_config = ConfigDict(extra="forbid")
    node_id: str
    at_s: float
    bucket_s: float = BUCKET_S
    buckets: list[TrafficBucket] = Field(default_factory=list)
    sessions: list[SessionInFlight] = Field(default_factory=list)
    kv_sessions: int = Field(default=0, ge=0)
    failovers: list[FailoverEvent] = Field(default_factory=list)
    error: str | None = None


    def redacted(self) -> "NodeTraffic":
        """This answer with every session id replaced by its :func:`session_alias`."""
        return self.model_copy(update={"sessions": _aliased(self.sessions), "failovers": _aliased(self.failovers)})


class MeshTraffic(BaseModel):
    """Body of the tracker's ``GET /v1/traffic[?buckets=N]``: every registered node's traffic
    (sorted by node id; its last ``N`` buckets, all :data:`BUCKET_COUNT` by default), the sessions in
    flight across the mesh (oldest first) and the failovers (newest first)."""

    model_config = ConfigDict(extra="forbid")
    at_s: float
    nodes: list[NodeTraffic]
    sessions: list[SessionInFlight]
    failovers: list[FailoverEvent]

    def redacted(self) -> "MeshTraffic":
        """This answer with every session id replaced by its :func:`session_alias`."""
        return self.model_copy(update={"sessions": _aliased(self.sessions), "failovers": _aliased(self.failovers)})


#: what an alias starts with, so nobody takes it for a session id
ALIAS_PREFIX = "s-"


def session_alias(session_id: str) -> str:
    """The name a session goes by in views for anyone but the operator (ADR-0049): ``s-`` and the
    first 12 hex digits of the id's SHA-256. The same session keeps its alias in every view and on
    every node, so a console can follow it, but the id (which names the session in tickets, releases
    and a node's health probe) cannot be read back from it."""
    return ALIAS_PREFIX + hashlib.sha256(session_id.encode()).hexdigest()[:12]


def _aliased(items: list) -> list:
    return [item.model_copy(update={"session_id": session_alias(item.session_id)}) for item in items]


def recent_summary(buckets: list[dict], last: int = 6) -> dict:
    """The last ``last`` buckets of a node (the JSON form of :class:`TrafficBucket`, oldest first)
    summed up: ``ttft_s`` and ``tpot_s`` (means weighted by their counts, None when nothing was
    observed), ``tokens_per_s`` (forward tokens over the span), ``batch_size`` (mean per forward,
    None without forwards) and ``batch_size_max``. ``bucket_s`` is taken as the spacing of
    ``start_s`` (10 s when there is one bucket)."""
    tail = buckets[-last:] if last > 0 else []
    span_s = len(tail) * (tail[1]["start_s"] - tail[0]["start_s"] if len(tail) > 1 else BUCKET_S)

    def weighted(value: str, count: str) -> float | None:
        n = sum(b.get(count) or 0 for b in tail if b.get(value) is not None)
        return sum(b[value] * (b.get(count) or 0) for b in tail if b.get(value) is not None) / n if n else None

    return {"ttft_s": weighted("ttft_s", "first_tokens"), "tpot_s": weighted("tpot_s", "finished"),
            "tokens_per_s": sum(b.get("forward_tokens") or 0 for b in tail) / span_s if span_s else 0.0,
            "batch_size": weighted("batch_size", "forwards"),
            "batch_size_max": max((b.get("batch_size_max") or 0 for b in tail), default=0)}
