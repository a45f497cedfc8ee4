"""Placement planner (meshnet.tracker.placement, ADR-0003 and ADR-0011): pure, table-driven."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from meshnet.tracker.placement import (
    MEMORY_FRACTION, Assignment, ModelSpec, NodeState, PlacementPlan, apply_plan, coverage_counts,
    find_assignment, find_gaps, layer_bytes, max_assignable_layers, memory_budget_bytes, plan_placement)

GIB = 1024**3
LAYER = 100   # bytes per layer of the toy models below: node capacity = vram * 0.8 / 100
SMOL = ModelSpec("smollm2", 30, {"bfloat16": 7080192, "int8": 3543552, "nf4": 1772352})


def model(name: str = "m", num_layers: int = 30, demand: float = 1.0) -> ModelSpec:
    return ModelSpec(name, num_layers, {"bfloat16": LAYER, "int8": LAYER // 2}, demand)


def node(node_id: str, layers: int = 30, speed: float = 10.0, slots: int = 1, shards=(),
         quant: str = "bfloat16", accepts: bool = True) -> NodeState:
    """A node whose memory budget holds exactly ``layers`` bfloat16 toy layers."""
    return NodeState(node_id, vram_bytes=layers * LAYER * 5 // 4, quantization=quant, tokens_per_s=speed,
                     max_loaded_shards=slots, assignments=tuple(shards), accepts_placement=accepts)


def shard(spec: str, start: int, end: int, tier: str = "bootstrap") -> Assignment:
    return Assignment(spec, LayerRange(start, end), tier)


def ranges(plan: PlacementPlan) -> dict[str, list[tuple[str, int, int, str]]]:
    return {n: [(a.model, a.layers.start, a.layers.end, a.tier) for a in shards]
            for n, shards in plan.assignments.items()}


def loads(plan: PlacementPlan) -> list[tuple[str, str, int, int]]:
    return sorted((n, a.model, a.layers.start, a.layers.end) for n, a in plan.loads)


# --- memory arithmetic -------------------------------------------------------------------

@pytest.mark.parametrize(("vram_bytes", "bytes_per_layer", "expected"), [
    (8 * GIB, 7080192, 970),        # 8 GiB of bfloat16 SmolLM2-135M layers
    (8 * GIB, 1772352, 3877),       # the same in nf4
    (1000, 250, 3),                 # 800 / 250 = 3.2
    (1000, 200, 4),                 # exactly 800 / 200
    (999, 200, 3),                  # floor(799.2) / 200
    (0, 100, 0),
    (-5, 100, 0),
])
def test_max_assignable_layers(vram_bytes, bytes_per_layer, expected):
    assert MEMORY_FRACTION == 0.8
    assert max_assignable_layers(vram_bytes, bytes_per_layer) == expected


@pytest.mark.parametrize(("vram_bytes", "expected"), [(1000, 800), (999, 799), (8 * GIB, 6871947673), (0, 0)])
def test_memory_budget_bytes(vram_bytes, expected):
    assert memory_budget_bytes(vram_bytes) == expected


def test_max_assignable_layers_rejects_non_positive_layer_size():
    with pytest.raises(ValueError):
        max_assignable_layers(GIB, 0)


# --- coverage ----------------------------------------------------------------------------

@pytest.mark.parametrize(("num_layers", "spans", "counts", "gaps"), [
    (4, [], [0, 0, 0, 0], [(0, 4)]),
    (4, [(0, 4)], [1, 1, 1, 1], []),
    (6, [(0, 2), (1, 3), (5, 6)], [1, 2, 1, 0, 0, 1], [(3, 5)]),
    (6, [(2, 4)], [0, 0, 1, 1, 0, 0], [(0, 2), (4, 6)]),
    (3, [(0, 9)], [1, 1, 1], []),   # a range past the model's end is clipped
])
def test_coverage_counts_and_gaps(num_layers, spans, counts, gaps):
    got = coverage_counts(num_layers, [LayerRange(a, b) for a, b in spans])
    assert got == counts
    assert find_gaps(num_layers, got) == [LayerRange(a, b) for a, b in gaps]


# --- find_assignment (GET /v1/network/assign) --------------------------------------------

@pytest.mark.parametrize(("counts", "vram_bytes", "expected", "gap_found"), [
    ([0] * 30, 8 * GIB, (0, 30), True),                    # empty model, room for it all
    ([1] * 10 + [0] * 20, 8 * GIB, (10, 30), True),        # the gap only
    ([1] * 10 + [0] * 20, 5 * 7080192, (10, 14), True),    # clipped to 4 layers of memory
    ([0] * 5 + [1] * 20 + [0] * 5, 8 * GIB, (0, 5), True),  # the first gap
    ([2] * 30, 8 * GIB, (0, 30), False),                   # no gap: the full model
    ([2] * 30, 2 * 7080192, (0, 30), False),               # ... whatever the memory
])
def test_find_assignment(counts, vram_bytes, expected, gap_found):
    assert find_assignment(SMOL, counts, vram_bytes, "bfloat16") == (LayerRange(*expected), gap_found)


@pytest.mark.parametrize(("vram_bytes", "quantization"), [(8 * GIB, "fp8"), (7080192, "bfloat16")])
def test_find_assignment_rejects(vram_bytes, quantization):
    with pytest.raises(InvalidRequest):
        find_assignment(SMOL, [0] * 30, vram_bytes, quantization)


# --- plan_placement: coverage first ------------------------------------------------------

def test_empty_network_and_no_models():
    assert plan_placement([], [model()]).loads == ()
    plan = plan_placement([node("a")], [])
    assert plan.loads == () and plan.drops == () and ranges(plan) == {"a": []}


def test_faster_node_gets_the_wider_range():
    nodes = [node("slow", layers=20, speed=5.0), node("fast", layers=20, speed=50.0)]
    plan = plan_placement(nodes, [model()])
    assert ranges(plan) == {"slow": [("m", 20, 30, "bootstrap")], "fast": [("m", 0, 20, "bootstrap")]}
    assert plan.reasons["fast"] == "assigned m 0-19 to fill a coverage gap"
    assert plan.drops == ()


def test_fastest_node_takes_the_whole_gap_and_the_rest_add_redundancy():
    nodes = [node("a", layers=40, speed=1.0), node("b", layers=40, speed=9.0)]
    plan = plan_placement(nodes, [model()])
    assert ranges(plan) == {"a": [("m", 0, 30, "bootstrap")], "b": [("m", 0, 30, "bootstrap")]}
    assert plan.reasons == {"b": "assigned m 0-29 to fill a coverage gap",
                            "a": "coverage complete; added redundancy m 0-29"}


def test_large_gap_is_split_across_nodes_in_speed_order():
    nodes = [node("n1", layers=8, speed=1.0), node("n2", layers=12, speed=3.0), node("n3", layers=12, speed=2.0)]
    plan = plan_placement(nodes, [model()])
    assert loads(plan) == [("n1", "m", 24, 30), ("n2", "m", 0, 12), ("n3", "m", 12, 24)]


def test_speed_ties_are_broken_by_node_id():
    plan = plan_placement([node("b", layers=15), node("a", layers=15)], [model()])
    assert loads(plan) == [("a", "m", 0, 15), ("b", "m", 15, 30)]


def test_only_the_gap_is_filled_around_existing_shards():
    nodes = [node("old", layers=30, shards=[shard("m", 0, 10)]), node("new", layers=30)]
    plan = plan_placement(nodes, [model()])
    assert loads(plan) == [("new", "m", 10, 30)]
    assert plan.reasons["old"] == "no free shard slot (1/1 used)"


def test_existing_shards_count_against_memory_and_slots():
    # budget 20 layers, 15 used by another model; 2 slots: only 5 layers of the gap fit
    nodes = [node("a", layers=20, slots=2, shards=[shard("other", 0, 15, "pinned")])]
    plan = plan_placement(nodes, [model(), model("other", 15)])
    assert loads(plan) == [("a", "m", 0, 5)]


def test_gaps_are_filled_before_any_redundancy():
    # "covered" has one copy and the highest demand, "gappy" has none: both idle nodes go to the gap
    nodes = [node("x", layers=30, speed=9.0, shards=[shard("covered", 0, 30)]),
             node("a", layers=15, speed=2.0), node("b", layers=15, speed=1.0)]
    plan = plan_placement(nodes, [model("covered", demand=100.0), model("gappy", demand=0.0)])
    assert loads(plan) == [("a", "gappy", 0, 15), ("b", "gappy", 15, 30)]


def test_models_are_served_in_order_of_demand():
    nodes = [node("only", layers=30, slots=1)]
    plan = plan_placement(nodes, [model("cold", demand=1.0), model("hot", demand=5.0)])
    assert loads(plan) == [("only", "hot", 0, 30)]


def test_a_node_with_spare_slots_fills_several_gaps():
    nodes = [node("big", layers=100, slots=3, speed=10.0)]
    plan = plan_placement(nodes, [model("a", 30), model("b", 20)])
    assert loads(plan) == [("big", "a", 0, 30), ("big", "b", 0, 20)]


def test_a_gap_no_node_can_hold_stays_open():
    small = ModelSpec("huge", 10, {"bfloat16": 10**12})
    plan = plan_placement([node("a")], [small])
    assert plan.loads == ()
    assert plan.reasons["a"] == "memory budget full"


@pytest.mark.parametrize(("nodes", "reason"), [
    ([node("a", accepts=False)], "not accepting placement"),
    ([node("a", shards=[shard("m", 0, 30)])], "no free shard slot (1/1 used)"),
    ([node("a", layers=30, slots=2, shards=[shard("m", 0, 30)])], "memory budget full"),
    ([node("a", layers=60, slots=2, shards=[shard("m", 0, 30)])],
     "no gap it can fill; keeps 1 shard(s), redundancy goes to idle nodes"),
    ([node("a", quant="nf4")], "memory budget full"),   # the model has no nf4 size
])
def test_reasons_for_nodes_that_get_nothing(nodes, reason):
    plan = plan_placement(nodes, [model()])
    assert plan.loads == ()
    assert plan.reasons["a"] == reason


def test_a_node_that_does_not_accept_placement_gets_nothing():
    plan = plan_placement([node("a", speed=99.0, accepts=False), node("b", layers=10)], [model()])
    assert loads(plan) == [("b", "m", 0, 10)]


def test_recipe_decides_bytes_per_layer():
    # int8 layers are half the size: a 15-layer bfloat16 budget holds all 30
    plan = plan_placement([node("q", layers=15, quant="int8")], [model()])
    assert loads(plan) == [("q", "m", 0, 30)]


# --- measured memory (ADR-0039) ---------------------------------------------------------

@pytest.mark.parametrize(("measured", "expected"), [
    ({}, 30),                       # no measurement: the preset's 100 bytes per layer
    ({"m": 100}, 30),               # equal to the preset
    ({"m": 50}, 30),                # smaller than the preset: the preset stays
    ({"other": 400}, 30),           # another model's figure does not apply
    ({"m": 125}, 24),               # 1.25x the preset: 3000 / 125
    ({"m": 200}, 15),
    ({"m": 3001}, 0),               # not even one layer fits
])
def test_a_larger_measured_figure_reduces_the_layers_assigned(measured, expected):
    n = NodeState("a", vram_bytes=30 * LAYER * 5 // 4, quantization="bfloat16", tokens_per_s=10.0,
                  max_loaded_shards=1, measured_bytes_per_layer=measured)
    plan = plan_placement([n], [model()])
    assert loads(plan) == ([("a", "m", 0, expected)] if expected else [])
    assert layer_bytes(n, model()) == max(LAYER, measured.get("m", 0))


@pytest.mark.parametrize(("measured", "expected"), [({}, 20), ({"m": 200}, 10)])
def test_held_shards_count_with_the_measured_figure(measured, expected):
    # 10 layers of m held: 1000 bytes at the preset, 2000 measured; the rest goes to m2's gap
    n = NodeState("a", vram_bytes=30 * LAYER * 5 // 4, quantization="bfloat16", tokens_per_s=10.0,
                  max_loaded_shards=2, assignments=(shard("m", 0, 10),), measured_bytes_per_layer=measured)
    plan = plan_placement([n, node("b", layers=20, shards=[shard("m", 10, 30)])], [model(), model("m2")])
    assert ("a", "m2", 0, expected) in loads(plan)


@pytest.mark.parametrize(("measured", "expected"), [({}, ("idle", "m", 0, 30)), ({"m": 200}, ("idle", "m", 0, 15))])
def test_redundancy_sizes_a_copy_with_the_measured_figure(measured, expected):
    idle = NodeState("idle", vram_bytes=30 * LAYER * 5 // 4, quantization="bfloat16", tokens_per_s=10.0,
                     max_loaded_shards=1, measured_bytes_per_layer=measured)
    plan = plan_placement([node("a", shards=[shard("m", 0, 30)]), idle], [model()])
    assert loads(plan) == [expected]


def test_a_recipe_without_a_preset_size_is_never_placed_even_when_measured():
    n = NodeState("a", vram_bytes=GIB, quantization="nf4", tokens_per_s=1.0, max_loaded_shards=1,
                  measured_bytes_per_layer={"m": 10})
    assert layer_bytes(n, model()) == 0
    assert loads(plan_placement([n], [model()])) == []


# --- redundancy --------------------------------------------------------------------------

def test_idle_node_adds_redundancy_to_the_highest_demand_per_copy():
    covered = [node("a1", shards=[shard("a", 0, 30)]),
               node("b1", shards=[shard("b", 0, 30)]), node("b2", shards=[shard("b", 0, 30)])]
    # a: 10 / 1 copy = 10, b: 16 / 2 copies = 8 -> a
    plan = plan_placement([*covered, node("idle")], [model("a", demand=10.0), model("b", demand=16.0)])
    assert loads(plan) == [("idle", "a", 0, 30)]
    assert plan.reasons["idle"] == "coverage complete; added redundancy a 0-29"


def test_equal_demand_redundancy_goes_to_the_model_with_fewest_copies():
    covered = [node("a1", shards=[shard("a", 0, 30)]), node("a2", shards=[shard("a", 0, 30)]),
               node("b1", shards=[shard("b", 0, 30)])]
    plan = plan_placement([*covered, node("idle")], [model("a"), model("b")])
    assert loads(plan) == [("idle", "b", 0, 30)]


def test_without_demand_an_idle_node_stays_a_hot_spare():
    covered = [node("a1", shards=[shard("a", 0, 30)])]
    plan = plan_placement([*covered, node("idle")], [model("a", demand=0.0)])
    assert loads(plan) == []
    assert plan.reasons["idle"] == "no gap it can fill and no fully covered model fits"


@pytest.mark.parametrize(("spans", "capacity", "expected"), [
    ([(0, 30), (0, 10)], 10, (10, 20)),            # layers 10-29 have one copy: start at 10
    ([(0, 30), (0, 25)], 10, (20, 30)),            # weakest run 25-29, moved left to fit
    ([(0, 30), (5, 30)], 10, (0, 10)),
    ([(0, 30), (0, 10), (20, 30)], 10, (10, 20)),  # exactly the weak middle
    ([(0, 30), (0, 10)], 99, (0, 30)),             # room for all of it: a whole copy
])
def test_partial_redundancy_covers_the_weakest_layers(spans, capacity, expected):
    covered = [node(f"c{k}", shards=[shard("m", a, b)]) for k, (a, b) in enumerate(spans)]
    plan = plan_placement([*covered, node("idle", layers=capacity)], [model()])
    assert loads(plan) == [("idle", "m", *expected)]


def test_several_idle_nodes_spread_over_the_weakest_layers():
    covered = [node("c", shards=[shard("m", 0, 30)])]
    idle = [node(f"i{k}", layers=10, speed=10.0 - k) for k in range(4)]
    plan = plan_placement([*covered, *idle], [model()])
    assert loads(plan) == [("i0", "m", 0, 10), ("i1", "m", 10, 20), ("i2", "m", 20, 30), ("i3", "m", 0, 10)]


def test_redundancy_follows_demand_per_copy_as_copies_grow():
    covered = [node("a1", shards=[shard("a", 0, 30)]), node("b1", shards=[shard("b", 0, 30)])]
    idle = [node(f"i{k}", speed=10.0 - k) for k in range(5)]
    plan = plan_placement([*covered, *idle], [model("a", demand=10.0), model("b", demand=6.0)])
    # a: 10/1, then b: 6/1 > 10/2, then a: 10/2 > 6/2, a: 10/3 > 6/2, then b: 6/2 > 10/4
    assert [a.model for _, a in sorted(plan.loads, key=lambda x: x[0])] == ["a", "b", "a", "a", "b"]


def test_partial_copies_count_the_whole_copies_placed_before_them():
    covered = [node("c1", shards=[shard("m", 0, 30)]), node("c2", shards=[shard("m", 0, 10)])]
    idle = [node("big", layers=30, speed=9.0), node("small", layers=10, speed=8.0),
            node("small2", layers=10, speed=7.0)]
    plan = plan_placement([*covered, *idle], [model()])
    assert loads(plan) == [("big", "m", 0, 30), ("small", "m", 10, 20), ("small2", "m", 20, 30)]


def test_nodes_with_shards_do_not_add_redundancy():
    plan = plan_placement([node("a", layers=90, slots=3, shards=[shard("m", 0, 30)])], [model()])
    assert plan.loads == ()


# --- tiers and anti-churn ----------------------------------------------------------------

def two_layer_network(tier: str, mover_speed: float) -> list[NodeState]:
    """Layer 1 is the bottleneck (100 tokens/s); layer 0 has spare throughput."""
    return [node("base", layers=2, speed=100.0, shards=[shard("m", 0, 2, "bootstrap")]),
            node("extra", layers=1, speed=100.0, shards=[shard("m", 0, 1, "bootstrap")]),
            node("mover", layers=1, speed=mover_speed, shards=[shard("m", 0, 1, tier)])]


@pytest.mark.parametrize(("tier", "speed", "min_gain", "moved"), [
    ("managed", 50.0, 0.1, True),      # bottleneck 100 -> 150: +50 % clears 10 %
    ("managed", 5.0, 0.1, False),      # 100 -> 105: +5 % is churn
    ("managed", 5.0, 0.01, True),      # ... unless the threshold is 1 %
    ("managed", 10.0, 0.1, False),     # 100 -> 110: exactly +10 % is not *more than* 10 %
    ("pinned", 50.0, 0.1, False),      # pinned never moves, even when it would help
    ("bootstrap", 50.0, 0.1, False),   # nor does bootstrap
])
def test_only_managed_shards_move_and_only_past_min_gain(tier, speed, min_gain, moved):
    plan = plan_placement(two_layer_network(tier, speed), [model(num_layers=2)], min_gain=min_gain)
    if moved:
        assert [(n, a.layers.start, a.tier) for n, a in plan.drops] == [("mover", 0, tier)]
        assert [(n, a.layers.start, a.tier) for n, a in plan.loads] == [("mover", 1, "managed")]
        assert plan.reasons["mover"] == "moved managed m 0-0 -> 1-1 to raise its bottleneck"
    else:
        assert plan.loads == () and plan.drops == ()


def test_managed_shard_moves_to_close_a_gap():
    nodes = [node("a", layers=10, shards=[shard("m", 0, 10, "bootstrap")]),
             node("b", layers=10, shards=[shard("m", 0, 10, "managed")])]
    plan = plan_placement(nodes, [model(num_layers=20)])
    assert [(n, a.layers.start, a.layers.end) for n, a in plan.drops] == [("b", 0, 10)]
    assert [(n, a.layers.start, a.layers.end) for n, a in plan.loads] == [("b", 10, 20)]


def test_pinned_shard_is_kept_even_when_a_gap_stays_open():
    nodes = [node("a", layers=10, shards=[shard("m", 0, 10, "bootstrap")]),
             node("b", layers=10, shards=[shard("m", 0, 10, "pinned")])]
    plan = plan_placement(nodes, [model(num_layers=20)])
    assert plan.loads == () and plan.drops == ()
    assert ranges(plan)["b"] == [("m", 0, 10, "pinned")]


def test_managed_shard_on_a_node_not_accepting_placement_stays():
    nodes = [node("a", layers=10, shards=[shard("m", 0, 10, "bootstrap")]),
             node("b", layers=10, accepts=False, shards=[shard("m", 0, 10, "managed")])]
    plan = plan_placement(nodes, [model(num_layers=20)])
    assert plan.loads == () and plan.drops == ()
    assert plan.reasons["b"] == "not accepting placement"


def test_negative_min_gain_is_rejected():
    with pytest.raises(ValueError):
        plan_placement([], [], min_gain=-0.1)


def test_shards_of_unknown_models_are_kept_and_hold_their_slot():
    plan = plan_placement([node("a", slots=1, shards=[shard("gone", 0, 4)])], [model()])
    assert plan.loads == () and ranges(plan)["a"] == [("gone", 0, 4, "bootstrap")]


# --- apply_plan and no oscillation -------------------------------------------------------

def test_apply_plan_replaces_assignments():
    nodes = [node("a", layers=15), node("b", layers=15)]
    plan = plan_placement(nodes, [model()])
    after = apply_plan(nodes, plan)
    assert [n.assignments for n in after] == [plan.assignments["a"], plan.assignments["b"]]
    assert [n.vram_bytes for n in after] == [n.vram_bytes for n in nodes]


def test_repeated_plan_apply_cycles_settle_after_one_plan():
    nodes = [node(f"n{k}", layers=7 + 5 * k, speed=3.0 + k % 4, slots=1 + k % 3,
                  shards=[shard("a", 0, 5, "managed")] if k % 5 == 0 else ()) for k in range(12)]
    models = [model("a", 30, demand=4.0), model("b", 24, demand=2.0), model("c", 40)]
    first = plan_placement(nodes, models)
    assert first.loads
    state = apply_plan(nodes, first)
    for _ in range(3):
        again = plan_placement(state, models)
        assert again.loads == () and again.drops == ()
        assert dict(again.assignments) == dict(first.assignments)
        state = apply_plan(state, again)


# --- properties over random networks -----------------------------------------------------

QUANTS = ("bfloat16", "int8", "nf4")


@st.composite
def networks(draw):
    models = [ModelSpec(f"m{k}", draw(st.integers(1, 12)),
                        {q: draw(st.integers(1, 50)) for q in draw(st.sets(st.sampled_from(QUANTS), min_size=1))},
                        draw(st.sampled_from([0.0, 1.0, 5.0])))
              for k in range(draw(st.integers(1, 3)))]
    nodes = []
    for k in range(draw(st.integers(0, 10))):
        quant, slots = draw(st.sampled_from(QUANTS)), draw(st.integers(1, 3))
        budget = draw(st.integers(0, 400))
        shards, used = [], 0
        for _ in range(draw(st.integers(0, slots))):
            spec = draw(st.sampled_from(models))
            start = draw(st.integers(0, spec.num_layers - 1))
            end = draw(st.integers(start + 1, spec.num_layers))
            size = (end - start) * spec.bytes_per_layer.get(quant, 0)
            if used + size <= budget:
                used += size
                shards.append(shard(spec.name, start, end, draw(st.sampled_from(["pinned", "bootstrap", "managed"]))))
        nodes.append(NodeState(f"n{k:02d}", -(-budget * 5 // 4) + draw(st.integers(0, 1)), quant,
                               draw(st.sampled_from([1.0, 2.0, 2.5, 7.0, 30.0])), slots, tuple(shards),
                               draw(st.booleans()) or k % 3 != 0))
    return nodes, models


def used_bytes(n: NodeState, shards, specs) -> int:
    return sum(len(a.layers) * specs[a.model].bytes_per_layer.get(n.quantization, 0) for a in shards)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(networks(), st.sampled_from([0.0, 0.1, 0.5]))
def test_plans_respect_limits_tiers_and_settle(network, min_gain):
    nodes, models = network
    specs = {m.name: m for m in models}
    plan = plan_placement(nodes, models, min_gain=min_gain)
    after = apply_plan(nodes, plan)
    for before, n in zip(nodes, after):
        assert used_bytes(n, n.assignments, specs) <= memory_budget_bytes(n.vram_bytes)
        assert len(n.assignments) <= n.max_loaded_shards
        kept = [a for a in before.assignments if a.tier != "managed"]
        assert all(a in n.assignments for a in kept)   # pinned and bootstrap never move
        if not n.accepts_placement:
            assert n.assignments == before.assignments
        assert isinstance(plan.reasons[n.node_id], str) and plan.reasons[n.node_id]
    assert all(a.tier == "managed" for _, a in plan.drops)
    assert all(a.tier in ("bootstrap", "managed") for _, a in plan.loads)
    # coverage first: a gap stays open only if no node has a free slot and room for one layer
    for spec in models:
        counts = coverage_counts(spec.num_layers, [a.layers for n in after for a in n.assignments
                                                   if a.model == spec.name])
        if find_gaps(spec.num_layers, counts):
            for n in after:
                room = memory_budget_bytes(n.vram_bytes) - used_bytes(n, n.assignments, specs)
                per_layer = spec.bytes_per_layer.get(n.quantization, 0)
                assert not (n.accepts_placement and len(n.assignments) < n.max_loaded_shards
                            and 0 < per_layer <= room)
    again = plan_placement(after, models, min_gain=min_gain)
    assert again.loads == () and again.drops == ()
