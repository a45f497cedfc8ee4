"""Route choice (meshnet.tracker.routing): cost model ADR-0004, overlapping shards ADR-0012."""

from __future__ import annotations

import random
import time

import pytest

from meshnet.errors import ModelNotRoutable
from meshnet.layers import LayerRange
from meshnet.tracker.routing import (
    Hop,
    NoRoute,
    ShardCandidate,
    choose_route,
    estimate_hop_seconds,
    seconds_per_layer,
)


def cand(node_id: str, start: int, end: int, tokens_per_s: float = 100.0, *, latency_s: float = 0.0,
         in_flight: int = 0, failure_age_s: float | None = None) -> ShardCandidate:
    """A candidate serving the half-open shard [start, end)."""
    return ShardCandidate(node_id, f"http://{node_id}:8000", LayerRange(start, end), tokens_per_s,
                          latency_s, in_flight, failure_age_s)


def hops(route: list[Hop]) -> list[tuple[str, int, int]]:
    return [(h.node_id, h.layers.start, h.layers.end) for h in route]


# (id, num_layers, candidates, keyword arguments, expected hops as (node, start, end))
ROUTE_CASES = [
    ("one node serves everything", 4, [cand("a", 0, 4)], {}, [("a", 0, 4)]),
    ("two halves", 4, [cand("b", 2, 4), cand("a", 0, 2)], {}, [("a", 0, 2), ("b", 2, 4)]),
    ("faster path wins over fewer hops", 4,
     [cand("slow", 0, 4, 10.0), cand("f1", 0, 2, 100.0), cand("f2", 2, 4, 100.0)], {},
     [("f1", 0, 2), ("f2", 2, 4)]),
    ("equal cost: fewer hops wins", 4,
     [cand("h1", 0, 2, 100.0), cand("h2", 2, 4, 100.0), cand("whole", 0, 4, 50.0)], {},
     [("whole", 0, 4)]),
    ("equal speed: less loaded wins", 4,
     [cand("busy", 0, 4, in_flight=2), cand("idle", 0, 4, in_flight=0)], {}, [("idle", 0, 4)]),
    ("no load penalty: lower in_flight breaks the tie", 4,
     [cand("a", 0, 4, in_flight=2), cand("b", 0, 4, in_flight=1)], {"load_penalty": 0.0}, [("b", 0, 4)]),
    ("full tie: smaller node id", 4, [cand("b", 0, 4), cand("a", 0, 4)], {}, [("a", 0, 4)]),
    ("load outweighs a small speed edge", 4,
     [cand("fast-busy", 0, 4, 120.0, in_flight=1), cand("slow-idle", 0, 4, 100.0)], {},
     [("slow-idle", 0, 4)]),
    ("latency counts per hop", 4,
     [cand("near", 0, 4, 50.0, latency_s=0.001), cand("far", 0, 4, 55.0, latency_s=0.05)], {},
     [("near", 0, 4)]),
    ("latency makes one long hop beat two fast ones", 4,
     [cand("one", 0, 4, 50.0, latency_s=0.01), cand("h1", 0, 2, 100.0, latency_s=0.01),
      cand("h2", 2, 4, 100.0, latency_s=0.01)], {}, [("one", 0, 4)]),
    ("overlap: hop starts inside the next node's shard", 8,
     [cand("a", 0, 5, 200.0), cand("b", 2, 8, 100.0)], {}, [("a", 0, 5), ("b", 5, 8)]),
    ("overlap: hop ends where a faster shard starts", 8,
     [cand("a", 0, 6, 60.0), cand("b", 3, 8, 500.0)], {}, [("a", 0, 3), ("b", 3, 8)]),
    ("start_layer > 0 routes the remaining layers", 8,
     [cand("entry", 0, 3), cand("m", 2, 6), cand("t", 6, 8)], {"start_layer": 3},
     [("m", 3, 6), ("t", 6, 8)]),
    ("start_layer inside the only shard", 8, [cand("all", 0, 8)], {"start_layer": 5}, [("all", 5, 8)]),
    ("shard past the model's end is clipped", 8, [cand("a", 0, 10)], {}, [("a", 0, 8)]),
    ("exclude avoids a node", 4, [cand("fast", 0, 4, 1000.0), cand("slow", 0, 4, 10.0)],
     {"exclude": {"fast"}}, [("slow", 0, 4)]),
    ("unmeasured node is never used", 4, [cand("new", 0, 4, 0.0), cand("old", 0, 4, 1.0)], {},
     [("old", 0, 4)]),
    ("failed recently: avoided while an alternative exists", 4,
     [cand("fast", 0, 4, 1000.0, failure_age_s=5.0), cand("slow", 0, 4, 10.0)], {}, [("slow", 0, 4)]),
    ("failure cooldown over: used again", 4,
     [cand("fast", 0, 4, 1000.0, failure_age_s=31.0), cand("slow", 0, 4, 10.0)], {}, [("fast", 0, 4)]),
    ("failure exactly at the cooldown boundary: usable", 4,
     [cand("fast", 0, 4, 1000.0, failure_age_s=30.0), cand("slow", 0, 4, 10.0)], {}, [("fast", 0, 4)]),
    ("shorter cooldown setting", 4,
     [cand("fast", 0, 4, 1000.0, failure_age_s=5.0), cand("slow", 0, 4, 10.0)],
     {"failure_cooldown_s": 2.0}, [("fast", 0, 4)]),
    ("failed recently but the only option: last resort", 4,
     [cand("only", 0, 4, failure_age_s=1.0)], {}, [("only", 0, 4)]),
    ("last resort: all usable nodes compete on cost", 4,
     [cand("cool", 0, 4, 1000.0, failure_age_s=1.0), cand("half", 0, 2, 10.0)], {}, [("cool", 0, 4)]),
    ("overlaps go to the fastest per layer", 12,
     [cand("a", 0, 5, 500.0), cand("b", 3, 9, 600.0), cand("c", 7, 12, 500.0)], {},
     [("a", 0, 3), ("b", 3, 9), ("c", 9, 12)]),
    ("slow middle node runs only the layers nobody else has", 12,
     [cand("a", 0, 5, 500.0), cand("b", 3, 9, 300.0), cand("c", 7, 12, 500.0)], {},
     [("a", 0, 5), ("b", 5, 7), ("c", 7, 12)]),
]


@pytest.mark.parametrize("num_layers, candidates, kwargs, expected",
                         [case[1:] for case in ROUTE_CASES], ids=[case[0] for case in ROUTE_CASES])
def test_choose_route(num_layers, candidates, kwargs, expected):
    route = choose_route(num_layers, candidates, **kwargs)
    assert hops(route) == expected
    by_id = {c.node_id: c for c in candidates}
    assert all(h.endpoint == by_id[h.node_id].endpoint for h in route)


# (id, num_layers, candidates, keyword arguments, expected gap_start)
NO_ROUTE_CASES = [
    ("no candidates", 4, [], {}, 0),
    ("nothing serves layer 0", 8, [cand("b", 2, 8)], {}, 0),
    ("gap in the middle", 8, [cand("a", 0, 3), cand("b", 4, 8)], {}, 3),
    ("last layer missing", 8, [cand("a", 0, 7)], {}, 7),
    ("furthest reach counts, not the first shard end", 8,
     [cand("a", 0, 3), cand("b", 2, 6), cand("c", 7, 8)], {}, 6),
    ("excluded node leaves a gap", 8, [cand("a", 0, 4), cand("b", 4, 8)], {"exclude": ["b"]}, 4),
    ("unmeasured node leaves a gap", 8, [cand("a", 0, 4), cand("b", 4, 8, 0.0)], {}, 4),
    ("gap after start_layer", 8, [cand("a", 0, 5)], {"start_layer": 2}, 5),
    ("nothing at start_layer", 8, [cand("a", 0, 3), cand("b", 5, 8)], {"start_layer": 4}, 4),
    ("cooling nodes do not hide the real gap", 8,
     [cand("a", 0, 5, failure_age_s=1.0), cand("b", 6, 8)], {}, 5),
]


@pytest.mark.parametrize("num_layers, candidates, kwargs, gap_start",
                         [case[1:] for case in NO_ROUTE_CASES], ids=[case[0] for case in NO_ROUTE_CASES])
def test_no_route_reports_the_gap(num_layers, candidates, kwargs, gap_start):
    with pytest.raises(NoRoute) as caught:
        choose_route(num_layers, candidates, **kwargs)
    assert caught.value.gap_start == gap_start
    assert isinstance(caught.value, ModelNotRoutable)
    assert caught.value.to_envelope()["error"]["code"] == "model_loading"


@pytest.mark.parametrize("num_layers, candidates, kwargs", [
    (4, [cand("a", 0, 4)], {"start_layer": 4}),
    (4, [cand("a", 0, 4)], {"start_layer": -1}),
    (4, [cand("a", 0, 2), cand("a", 2, 4)], {}),
], ids=["start_layer at the end", "negative start_layer", "node listed twice"])
def test_choose_route_rejects_bad_input(num_layers, candidates, kwargs):
    with pytest.raises(ValueError):
        choose_route(num_layers, candidates, **kwargs)


# (id, candidate, n_layers, load_penalty, expected seconds per token)
HOP_SECONDS_CASES = [
    ("whole shard, idle", cand("a", 0, 4, 100.0), 4, 0.5, 0.01),
    ("half the shard", cand("a", 0, 4, 100.0), 2, 0.5, 0.005),
    ("latency added once", cand("a", 0, 4, 100.0, latency_s=0.02), 2, 0.5, 0.025),
    ("two in flight double the compute", cand("a", 0, 4, 100.0, latency_s=0.01, in_flight=2), 2, 0.5, 0.02),
    ("penalty setting", cand("a", 0, 4, 100.0, in_flight=2), 4, 0.25, 0.015),
    ("unmeasured is infinite", cand("a", 0, 4, 0.0), 1, 0.5, float("inf")),
]


@pytest.mark.parametrize("candidate, n_layers, load_penalty, expected",
                         [case[1:] for case in HOP_SECONDS_CASES], ids=[case[0] for case in HOP_SECONDS_CASES])
def test_estimate_hop_seconds(candidate, n_layers, load_penalty, expected):
    assert estimate_hop_seconds(candidate, n_layers, load_penalty=load_penalty) == pytest.approx(expected)


def test_seconds_per_layer_spreads_shard_time_over_its_layers():
    assert seconds_per_layer(cand("a", 0, 10, 50.0)) == pytest.approx(0.002)
    assert seconds_per_layer(cand("a", 0, 10, 50.0, in_flight=1)) == pytest.approx(0.003)


def _ps(seconds: float) -> int:
    return round(seconds * 10**12)


def _hop_key(c: ShardCandidate, n_layers: int) -> tuple:
    """(cost in whole ps, hops, in_flight, ids) of one hop: the documented cost and tie-break."""
    return (n_layers * _ps(seconds_per_layer(c)) + _ps(c.latency_s), 1, c.in_flight, (c.node_id,))


def _add(key: tuple, hop: tuple) -> tuple:
    return tuple(a + b for a, b in zip(key, hop))


def _brute_force_best(num_layers, candidates, start_layer):
    """Best key over every hop sequence split at any layer, and the furthest layer reached."""
    best = {start_layer: (0, 0, 0, ())}
    for a in range(start_layer, num_layers):
        if a not in best:
            continue
        for c in candidates:
            if c.layers.start <= a < c.layers.end:
                for b in range(a + 1, min(c.layers.end, num_layers) + 1):
                    key = _add(best[a], _hop_key(c, b - a))
                    best[b] = min(best.get(b, key), key)
    return best.get(num_layers), max(best)


def _route_key(route, candidates):
    by_id = {c.node_id: c for c in candidates}
    key = (0, 0, 0, ())
    for hop in route:
        key = _add(key, _hop_key(by_id[hop.node_id], len(hop.layers)))
    return key


def _random_instance(rng):
    num_layers = rng.randint(2, 8)
    candidates = []
    for n in range(rng.randint(0, 7)):
        start = rng.randrange(num_layers)
        end = rng.randint(start + 1, num_layers)
        candidates.append(cand(f"n{n}", start, end, rng.choice([10.0, 20.0, 40.0, 80.0]),
                               latency_s=rng.choice([0.0, 0.0, 0.001, 0.01]), in_flight=rng.choice([0, 0, 1, 3])))
    return num_layers, candidates, rng.randrange(num_layers)


def test_matches_brute_force_cost_and_tie_break_on_random_small_meshes():
    rng = random.Random(1234)
    for _ in range(600):
        num_layers, candidates, start_layer = _random_instance(rng)
        best_key, reach = _brute_force_best(num_layers, candidates, start_layer)
        if best_key is None:
            with pytest.raises(NoRoute) as caught:
                choose_route(num_layers, candidates, start_layer=start_layer)
            assert caught.value.gap_start == reach
            continue
        route = choose_route(num_layers, candidates, start_layer=start_layer)
        assert _route_key(route, candidates) == best_key
        _assert_valid(route, candidates, start_layer, num_layers)
        shuffled = candidates[:]
        rng.shuffle(shuffled)
        assert choose_route(num_layers, shuffled, start_layer=start_layer) == route


def _assert_valid(route, candidates, start_layer, num_layers):
    by_id = {c.node_id: c for c in candidates}
    assert route[0].layers.start == start_layer and route[-1].layers.end == num_layers
    for before, after in zip(route, route[1:]):
        assert before.layers.end == after.layers.start
        assert before.node_id != after.node_id
    for hop in route:
        assert by_id[hop.node_id].layers.contains_range(hop.layers)


def test_thousand_candidates_eighty_layers_is_fast():
    rng = random.Random(7)
    candidates = []
    for n in range(1000):
        start = rng.randrange(80)
        candidates.append(cand(f"n{n:04d}", start, rng.randint(start + 1, 80), rng.uniform(5.0, 100.0),
                               latency_s=rng.uniform(0.0, 0.05), in_flight=rng.randrange(4)))
    route = choose_route(80, candidates)
    _assert_valid(route, candidates, 0, 80)
    cpu_s = []  # CPU time of this process: other work on a shared CI box does not count
    for _ in range(5):
        began = time.process_time()
        choose_route(80, candidates)
        cpu_s.append(time.process_time() - began)
    assert min(cpu_s) < 0.020
