"""Demand placement safety policy: when the tracker may move a managed node to another model.

Nodes come in three tiers (docs/adr/0026-assignment-tiers.md): ``pinned`` shards are set
by the operator, ``bootstrap`` shards are assigned once when a node first joins, and
``managed`` nodes follow demand. Only managed nodes are ever moved by demand, and only
when the move is safe and worth it (docs/adr/0005-demand-placement-safety-policy.md):
the old model keeps enough copies, the new model's demand clearly exceeds the old one's,
and the node has not moved recently.

Pure: no I/O, no clock. Callers pass ages in seconds and demand as numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshnet.protocol.control import TIERS  # most to least sticky (ADR-0026)

__all__ = [
    "COOLDOWN_S",
    "DEMAND_MULTIPLIER",
    "MIN_COPIES_LEFT",
    "TIERS",
    "MoveCandidate",
    "MoveDecision",
    "may_move",
    "pick_managed_nodes",
]

#: Copies of the old model that must remain after a move (ADR-0005).
MIN_COPIES_LEFT = 3
#: The new model's demand must be at least this multiple of the old model's (ADR-0005).
DEMAND_MULTIPLIER = 1.5
#: Seconds a managed node stays on a model before it may move again (ADR-0005).
COOLDOWN_S = 300.0


@dataclass(frozen=True)
class MoveCandidate:
    """A node the tracker might point at another model.

    Attributes:
        node_id: the node's id.
        tier: one of :data:`TIERS`.
        from_model: the model it serves now; None when it serves none.
        seconds_since_last_move: seconds since its last move; None = never moved.
        tokens_per_s: its measured speed, tokens/s; orders :func:`pick_managed_nodes`.
    """

    node_id: str
    tier: str
    from_model: str | None
    seconds_since_last_move: float | None
    tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")


@dataclass(frozen=True)
class MoveDecision:
    """Whether a move is allowed, and the rule that decided it (for logs and the console)."""

    allowed: bool
    reason: str


def may_move(candidate: MoveCandidate, *, from_model_copies: int, from_model_demand: float,
             to_model_demand: float, cooldown_s: float = COOLDOWN_S,
             min_copies_left: int = MIN_COPIES_LEFT,
             demand_multiplier: float = DEMAND_MULTIPLIER) -> MoveDecision:
    """Decide whether demand placement may move ``candidate`` to a new model (ADR-0005).

    Rules, checked in this order; the first that fails is the reason:

    1. Only ``managed`` nodes move; ``pinned`` and ``bootstrap`` never do (ADR-0026).
    2. A managed node serving no model is always eligible.
    3. A node never leaves a model for one without demand (``to_model_demand > 0``).
    4. Its cooldown has elapsed: ``seconds_since_last_move >= cooldown_s`` (None = never moved).
    5. The old model keeps enough copies: ``from_model_copies - 1 >= min_copies_left``.
    6. The demand is worth it: ``to_model_demand >= demand_multiplier * from_model_demand``.

    Args:
        from_model_copies: copies of the old model now, this node included: the fewest
            nodes serving any one layer of this node's shard (the fewest over the whole
            model, as :func:`pick_managed_nodes` is given, is the conservative form).
        from_model_demand: demand for the old model, requests per minute.
        to_model_demand: demand for the new model, requests per minute.
        cooldown_s: seconds a node stays put after a move.
    """
    if candidate.tier != "managed":
        return MoveDecision(False, f"{candidate.tier} nodes never move on demand")
    if candidate.from_model is None:
        return MoveDecision(True, "serves no model")
    if to_model_demand <= 0:
        return MoveDecision(False, "the new model has no demand")
    age_s = candidate.seconds_since_last_move
    if age_s is not None and age_s < cooldown_s:
        return MoveDecision(False, f"moved {age_s:g} s ago; cooldown is {cooldown_s:g} s")
    if from_model_copies - 1 < min_copies_left:
        return MoveDecision(False, f"{candidate.from_model} would keep {from_model_copies - 1} copies, "
                                   f"needs {min_copies_left}")
    if to_model_demand < demand_multiplier * from_model_demand:
        return MoveDecision(False, f"demand {to_model_demand:g} is under {demand_multiplier:g}x "
                                   f"{candidate.from_model}'s {from_model_demand:g}")
    return MoveDecision(True, f"demand {to_model_demand:g} is at least {demand_multiplier:g}x "
                              f"{candidate.from_model}'s {from_model_demand:g}")


def pick_managed_nodes(to_model: str, candidates: Sequence[MoveCandidate], *, needed: int,
                       model_copies: Mapping[str, int], model_demand: Mapping[str, float],
                       cooldown_s: float = COOLDOWN_S, min_copies_left: int = MIN_COPIES_LEFT,
                       demand_multiplier: float = DEMAND_MULTIPLIER) -> list[MoveCandidate]:
    """Choose up to ``needed`` managed nodes to serve ``to_model`` (ADR-0005).

    Idle managed nodes (serving no model) come first, fastest first; then managed nodes
    serving another model that :func:`may_move` allows, fastest first. Speed ties go to
    the smaller node id. Nodes already serving ``to_model`` are skipped. Each pick from
    a model lowers that model's copy count for the picks after it, so one call never
    takes a model below ``min_copies_left``.

    Args:
        to_model: the model that needs nodes.
        needed: how many nodes to pick at most.
        model_copies: copies per model now, the fewest nodes serving any one of its
            layers; absent counts as 0.
        model_demand: demand per model, requests per minute; absent counts as 0.
    """
    copies = dict(model_copies)
    pool = [c for c in candidates if c.tier == "managed" and c.from_model != to_model]
    pool.sort(key=lambda c: (c.from_model is not None, -c.tokens_per_s, c.node_id))
    picked: list[MoveCandidate] = []
    for candidate in pool:
        if len(picked) >= needed:
            break
        source = candidate.from_model
        decision = may_move(candidate, from_model_copies=copies.get(source, 0) if source else 0,
                            from_model_demand=model_demand.get(source, 0.0) if source else 0.0,
                            to_model_demand=model_demand.get(to_model, 0.0), cooldown_s=cooldown_s,
                            min_copies_left=min_copies_left, demand_multiplier=demand_multiplier)
        if decision.allowed:
            picked.append(candidate)
            if source is not None:
                copies[source] = copies.get(source, 0) - 1
    return picked
