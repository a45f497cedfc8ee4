"""Quarantine: a node outvoted by a spot-check is never routed until an operator reinstates it (ADR-0042).

An entry node that found a node outvoted (:mod:`meshnet.gateway.spotcheck`) reports it with
the evidence: the two witnesses and the three pairwise distances. The tracker does not take
the entry's word for the verdict: :func:`judge` checks that the sender may report on that node
at all, that the witnesses are other admitted holders of the same layers and recipe, and
re-counts the vote with its own tolerance for that recipe. A quarantine is kept by node id (a
re-registration keeps it), kept in the tracker's store (a restart keeps it, and every tracker
of a shared database applies it), shown in ``GET /v1/nodes`` with its evidence, and lifted only
by ``POST /v1/operator/reinstate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshnet.protocol.control import QuarantineReport
from meshnet.dataplane.evidence import outvoted, tolerance

__all__ = ["Quarantine", "judge"]


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


def _pairs(distances: dict[str, float]) -> dict[tuple[str, str], float]:
    out = {}
    for key, value in distances.items():
        a, sep, b = key.partition("|")
        if sep and a and b:
            out[(a, b)] = value
    return out


def judge(sender: str, accused: str, report: QuarantineReport, holder_recipes: dict[str, tuple[str, str]]) -> str:
    """Why the report does not quarantine ``accused`` ("" when it does).

    Args:
        sender: the entry node that signed the report (the caller checked it may report on
            ``accused``, as for a failure report).
        accused: the node the report names.
        report: the evidence.
        holder_recipes: node id -> recipe (quantization, compute dtype) of every node holding an
            admitted shard of ``report.model`` that covers the reported layers (the accused included).
    """
    witnesses = list(report.witnesses)
    if accused in witnesses or len(set(witnesses)) != 2:
        return "the witnesses must be two nodes other than the accused"
    if sender in witnesses:
        return "the reporting entry cannot witness its own report"
    missing = [n for n in [accused, *witnesses] if n not in holder_recipes]
    if missing:
        return f"{', '.join(missing)} hold(s) no admitted shard covering layers {report.shard_start}-{report.shard_end}"
    recipes = {holder_recipes[n] for n in [accused, *witnesses]}
    if len(recipes) != 1:
        return "the three holders do not share one recipe (quantization and compute dtype)"
    limit = tolerance(*next(iter(recipes)))
    loser = outvoted(accused, witnesses[0], witnesses[1], _pairs(report.distances), limit)
    if loser != accused:
        return f"the distances do not outvote {accused} at tolerance {limit}"
    return ""
