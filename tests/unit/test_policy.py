"""Demand placement safety policy (meshnet.tracker.policy): ADR-0005 rules, ADR-0026 tiers."""

from __future__ import annotations

import pytest

from meshnet.tracker.policy import (
    COOLDOWN_S,
    DEMAND_MULTIPLIER,
    MIN_COPIES_LEFT,
    TIERS,
    MoveCandidate,
    MoveDecision,
    may_move,
    pick_managed_nodes,
)


def node(node_id: str = "n1", tier: str = "managed", from_model: str | None = "old",
         since_move_s: float | None = None, tokens_per_s: float = 10.0) -> MoveCandidate:
    return MoveCandidate(node_id, tier, from_model, since_move_s, tokens_per_s)


def test_constants_match_adr_0005_and_0026():
    assert TIERS == ("pinned", "bootstrap", "managed")
    assert (MIN_COPIES_LEFT, DEMAND_MULTIPLIER, COOLDOWN_S) == (3, 1.5, 300.0)


SAFE = {"from_model_copies": 10, "from_model_demand": 2.0, "to_model_demand": 100.0}

# (id, candidate, keyword overrides of SAFE, allowed, words expected in the reason)
MAY_MOVE_CASES = [
    ("pinned never moves", node(tier="pinned"), {}, False, "pinned"),
    ("pinned never moves, even idle", node(tier="pinned", from_model=None), {}, False, "pinned"),
    ("bootstrap never moves", node(tier="bootstrap"), {}, False, "bootstrap"),
    ("bootstrap never moves, even idle", node(tier="bootstrap", from_model=None), {}, False, "bootstrap"),
    ("managed, every rule passes", node(), {}, True, "at least 1.5x"),
    ("idle managed node: always eligible", node(from_model=None, since_move_s=1.0),
     {"from_model_copies": 0, "to_model_demand": 0.0}, True, "serves no model"),
    ("no demand for the new model", node(), {"to_model_demand": 0.0}, False, "no demand"),
    ("4 copies now: exactly 3 left is allowed", node(), {"from_model_copies": 4}, True, "at least"),
    ("3 copies now: 2 left is refused", node(), {"from_model_copies": 3}, False, "keep 2 copies"),
    ("1 copy now: would orphan the model", node(), {"from_model_copies": 1}, False, "keep 0 copies"),
    ("demand exactly 1.5x is allowed", node(), {"from_model_demand": 4.0, "to_model_demand": 6.0}, True,
     "at least"),
    ("demand just under 1.5x is refused", node(), {"from_model_demand": 4.0, "to_model_demand": 5.99},
     False, "under 1.5x"),
    ("demand equal is refused", node(), {"from_model_demand": 4.0, "to_model_demand": 4.0}, False, "under"),
    ("old model without demand: any demand wins", node(), {"from_model_demand": 0.0, "to_model_demand": 1.0},
     True, "at least"),
    ("never moved: cooldown elapsed", node(since_move_s=None), {}, True, "at least"),
    ("cooldown exactly elapsed", node(since_move_s=300.0), {}, True, "at least"),
    ("cooldown not yet elapsed", node(since_move_s=299.9), {}, False, "cooldown is 300 s"),
    ("moved a second ago", node(since_move_s=1.0), {}, False, "moved 1 s ago"),
    ("custom cooldown", node(since_move_s=61.0), {"cooldown_s": 60.0}, True, "at least"),
    ("custom copies floor", node(), {"from_model_copies": 2, "min_copies_left": 1}, True, "at least"),
    ("custom multiplier", node(), {"from_model_demand": 4.0, "to_model_demand": 7.0, "demand_multiplier": 2.0},
     False, "under 2x"),
    ("cooldown is reported before copies", node(since_move_s=10.0), {"from_model_copies": 1}, False,
     "cooldown"),
    ("copies are reported before demand", node(), {"from_model_copies": 3, "to_model_demand": 1.0}, False,
     "copies"),
]


@pytest.mark.parametrize("candidate, overrides, allowed, reason_part",
                         [case[1:] for case in MAY_MOVE_CASES], ids=[case[0] for case in MAY_MOVE_CASES])
def test_may_move(candidate, overrides, allowed, reason_part):
    decision = may_move(candidate, **{**SAFE, **overrides})
    assert isinstance(decision, MoveDecision)
    assert decision.allowed is allowed
    assert reason_part in decision.reason


def test_unknown_tier_is_rejected():
    with pytest.raises(ValueError):
        node(tier="volunteer")


COPIES = {"old": 5, "other": 4, "target": 1}
DEMAND = {"old": 2.0, "other": 2.0, "target": 10.0}
FLEET = [
    node("pinned-idle", tier="pinned", from_model=None, tokens_per_s=999.0),
    node("boot-idle", tier="bootstrap", from_model=None, tokens_per_s=999.0),
    node("idle-slow", from_model=None, tokens_per_s=5.0),
    node("idle-fast", from_model=None, tokens_per_s=50.0),
    node("old-a", from_model="old", tokens_per_s=40.0),
    node("old-b", from_model="old", tokens_per_s=30.0),
    node("old-c", from_model="old", tokens_per_s=20.0),
    node("other-fast", from_model="other", tokens_per_s=100.0),
    node("other-cooling", from_model="other", since_move_s=10.0, tokens_per_s=200.0),
    node("already", from_model="target", tokens_per_s=500.0),
]

# (id, fleet, needed, copies, demand, expected node ids in pick order)
PICK_CASES = [
    ("idle nodes first, fastest first", FLEET, 2, COPIES, DEMAND, ["idle-fast", "idle-slow"]),
    ("then movable nodes, fastest first, copies counted down", FLEET, 10, COPIES, DEMAND,
     ["idle-fast", "idle-slow", "other-fast", "old-a", "old-b"]),
    ("needed 0 picks nothing", FLEET, 0, COPIES, DEMAND, []),
    ("demand too low to move anyone: only idle nodes", FLEET, 10, COPIES, {**DEMAND, "target": 2.9},
     ["idle-fast", "idle-slow"]),
    ("no demand at all: idle nodes are still eligible", FLEET, 10, COPIES, {},
     ["idle-fast", "idle-slow"]),
    ("unknown copies count as none", FLEET, 10, {}, DEMAND, ["idle-fast", "idle-slow"]),
    ("speed ties go to the smaller node id", [node("b", from_model=None), node("a", from_model=None)], 2,
     COPIES, DEMAND, ["a", "b"]),
]


@pytest.mark.parametrize("fleet, needed, copies, demand, expected",
                         [case[1:] for case in PICK_CASES], ids=[case[0] for case in PICK_CASES])
def test_pick_managed_nodes(fleet, needed, copies, demand, expected):
    picked = pick_managed_nodes("target", fleet, needed=needed, model_copies=copies, model_demand=demand)
    assert [c.node_id for c in picked] == expected


def test_pick_managed_nodes_passes_the_policy_settings_through():
    picked = pick_managed_nodes("target", FLEET, needed=10, model_copies=COPIES, model_demand=DEMAND,
                                cooldown_s=5.0, min_copies_left=1, demand_multiplier=5.0)
    assert [c.node_id for c in picked] == [
        "idle-fast", "idle-slow", "other-cooling", "other-fast", "old-a", "old-b", "old-c"]


def test_pick_managed_nodes_does_not_mutate_inputs():
    copies = dict(COPIES)
    pick_managed_nodes("target", FLEET, needed=10, model_copies=copies, model_demand=DEMAND)
    assert copies == COPIES
