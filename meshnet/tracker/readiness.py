"""Tracker readiness: can a chat be served through this tracker now, and if not, why (ADR-0032).

Liveness (``GET /v1/health``) says the process runs. Readiness (``GET /v1/ready``) says a
chat would be served: the tracker is not draining and at least one tracked model is
routable (or, with ``?model=``, that model is). A model that is not routable is listed
with its coverage gaps, so an operator sees which layers are missing.

"Any model" rather than "every model": a tracker also tracks models that a client merely
asked for (demand); one unserved request must not take the whole tracker out of a load
balancer.
"""

from __future__ import annotations


def gaps(coverage: dict) -> list[dict]:
    """Coverage gaps of one model's coverage map: ``[{"start_layer", "end_layer"}]`` (inclusive)."""
    return [{"start_layer": s["start_layer"], "end_layer": s["end_layer"]}
            for s in coverage["segments"] if s["node_count"] == 0]


def model_reason(coverage: dict) -> str | None:
    """Why one model is not routable (None when it is)."""
    if coverage["routable"]:
        return None
    holes = gaps(coverage)
    if holes:
        spans = ", ".join(f"{g['start_layer']}-{g['end_layer']}" for g in holes)
        return f"{coverage['model']}: coverage gap at layers {spans} (no admitted node serves them)"
    return f"{coverage['model']}: no admitted entry node (one serving layer 0 with the embeddings)"


def tracker_readiness(coverages: list[dict], *, draining: bool = False) -> dict:
    """Readiness from the coverage maps of the models asked about.

    Args:
        coverages: :meth:`TrackerService.coverage` dicts, one per model asked about.
        draining: the tracker is shutting down (takes no new chats).

    Returns:
        ``{"ready": bool, "reasons": [str], "models": [{"model", "routable", "gaps"}]}``;
        ``reasons`` is empty exactly when ready. Not ready: draining, no model tracked, or no
        model asked about routable (each unroutable model then gives its reason).
    """
    models = [{"model": c["model"], "routable": c["routable"], "gaps": gaps(c)} for c in coverages]
    reasons = ["draining: the tracker is shutting down and takes no new chats"] if draining else []
    if not coverages:
        reasons.append("no model is tracked (start the tracker with --model, or start a node with a shard)")
    elif not any(c["routable"] for c in coverages):
        reasons.extend(model_reason(c) for c in coverages)
    return {"ready": not reasons, "reasons": reasons, "models": models}
