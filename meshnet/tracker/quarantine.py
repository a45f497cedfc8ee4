"""Quarantine: a node outvoted on the tracker's own measurements is never routed until an operator
reinstates it (ADR-0042, ADR-0067).

The tracker quarantines a node that an admission challenge outvoted, or that an audit's
re-run outvoted (:mod:`meshnet.tracker.audit`: an entry brings the node's own signed steps, the
tracker re-runs them on two holders it picks), and an entry whose accusations proved false or
forged. A quarantine is kept by node id (a re-registration keeps it), kept in the tracker's
store (a restart keeps it, and every tracker of a shared database applies it), shown in
``GET /v1/nodes`` with its evidence, and lifted only by ``POST /v1/operator/reinstate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Quarantine"]


@dataclass(frozen=True)
class Quarantine:
    """Why a node is quarantined: who reported it, when (unix seconds), over which layers, and
    the evidence (witnesses, distances keyed ``"a|b"``, the tolerance the tracker applied)."""

    node_id: str
    reported_by: str
    model: str
    shard_start: int
    shard_end: int
    witnesses: tuple[str, ...]
    distances: dict[str, float]
    tolerance: float
    since: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        """The JSON form shown in ``GET /v1/nodes`` (``quarantine``)."""
        return {"reported_by": self.reported_by, "model": self.model, "shard_start": self.shard_start,
                "shard_end": self.shard_end, "witnesses": list(self.witnesses), "distances": dict(self.distances),
                "tolerance": self.tolerance, "since": self.since}

    @classmethod
    def from_json(cls, node_id: str, data: dict) -> "Quarantine":
        """The record of :meth:`to_json` (as the tracker's store keeps it), for ``node_id``.

        Raises:
            KeyError, TypeError, ValueError: ``data`` is not such a record.
        """
        return cls(node_id=node_id, reported_by=str(data["reported_by"]), model=str(data["model"]),
                   shard_start=int(data["shard_start"]), shard_end=int(data["shard_end"]),
                   witnesses=tuple(str(w) for w in data["witnesses"]),
                   distances={str(k): float(v) for k, v in dict(data["distances"]).items()},
                   tolerance=float(data["tolerance"]), since=float(data["since"]))
