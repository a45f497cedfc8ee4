"""Rebalance over a real TrackerService: demand moves managed nodes under the safety policy."""

from __future__ import annotations

import time

import pytest

from meshnet.tracker.rebalance import rebalance
from meshnet.protocol.control import RegisterRequest
from meshnet.tracker.service import TrackerService, TrackerSettings
from tests.payloads import capability_report, registration


def service_with(copies: int, tier: str = "managed") -> TrackerService:
    svc = TrackerService(TrackerSettings(models=("tiny-llama",)))
    for i in range(copies):
        report = capability_report("tiny-llama", 0, 3, tokens_per_s=10.0 + i)
        svc.register(RegisterRequest.model_validate(registration(
            f"n{i}", f"http://127.0.0.1:{9000 + i}",
            shards=[{"model": "tiny-llama", "shard_start": 0, "shard_end": 3, "tier": tier, "entry": True,
                     "report": report}])))
        svc.set_reachability(f"n{i}", f"http://127.0.0.1:{9000 + i}", "")  # as a probe that answered
    return svc


def directives(svc) -> list[tuple]:
    return sorted((d.node_id, d.type, d.model, d.shard_start, d.shard_end, d.tier)
                  for d in svc.store.directives())


@pytest.mark.parametrize(("copies", "moved"), [(4, True), (3, False)])
def test_demand_moves_a_managed_node_only_when_three_copies_stay(copies, moved):
    svc = service_with(copies)
    svc.add_demand("tiny-gpt2")
    rebalance(svc)
    expected = [("n3", "DROP_SHARD", "tiny-llama", 0, 3, "managed"),
                ("n3", "LOAD_SHARD", "tiny-gpt2", 0, 3, "managed")] if moved else []
    assert directives(svc) == expected  # the fastest eligible node (n3: 13 tokens/s) moves


def test_pinned_nodes_never_move_for_demand():
    svc = service_with(5, tier="pinned")
    svc.add_demand("tiny-gpt2")
    rebalance(svc)
    assert directives(svc) == []


def test_cooldown_keeps_a_recently_moved_node_in_place():
    svc = service_with(5)
    for node in svc.nodes.values():
        node.last_move_s = time.monotonic()
    svc.add_demand("tiny-gpt2")
    rebalance(svc)
    assert directives(svc) == []


def test_demand_must_be_one_and_a_half_times_the_old_models():
    svc = service_with(4)
    now = time.monotonic()
    for _ in range(2):
        svc.add_served("tiny-llama", now)
    for _ in range(2):
        svc.add_demand("tiny-gpt2", now)
    rebalance(svc)
    assert directives(svc) == []  # 2 requests vs 2: below 1.5x
    for _ in range(2):
        svc.add_demand("tiny-gpt2", now)
    rebalance(svc)
    assert [d[1] for d in directives(svc)] == ["DROP_SHARD", "LOAD_SHARD"]  # 4 requests vs 2: 2x


@pytest.mark.parametrize(("resident_bytes", "quantization", "expected"), [
    (None, "bfloat16", {}),                    # an older node: no measured figure
    (4_000_001, "bfloat16", {"tiny-llama": 1_000_001}),   # ceil over the shard's 4 layers
    (4_000_000, "int8", {}),                   # measured in another recipe than the node's
])
def test_placement_inputs_carry_the_measured_bytes_per_layer(resident_bytes, quantization, expected):
    from meshnet.tracker.rebalance import placement_inputs

    svc = TrackerService(TrackerSettings(models=("tiny-llama",)))
    report = {**capability_report("tiny-llama", 0, 3), "resident_bytes": resident_bytes}
    svc.register(RegisterRequest.model_validate(registration(
        "n0", "http://127.0.0.1:9000", shards=[{"model": "tiny-llama", "shard_start": 0, "shard_end": 3,
                                                "entry": True, "quantization": quantization, "report": report}])))
    nodes, _ = placement_inputs(svc)
    assert nodes[0].measured_bytes_per_layer == expected
