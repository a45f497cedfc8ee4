"""Rebalance over a real TrackerService: demand moves managed nodes under the safety policy."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from meshnet.tracker.rebalance import rebalance, rebalance_off_loop
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


async def test_off_loop_rebalance_writes_the_same_directives_in_one_batch():
    svc = service_with(4)
    svc.add_demand("tiny-gpt2")
    batches = []
    write = svc.store.add_directives
    svc.store.add_directives = lambda new, term=None: batches.append(len(new)) or write(new, term=term)
    await rebalance_off_loop(svc)
    assert batches == [2]
    assert directives(svc) == [("n3", "DROP_SHARD", "tiny-llama", 0, 3, "managed"),
                               ("n3", "LOAD_SHARD", "tiny-gpt2", 0, 3, "managed")]
    assert svc.nodes["n3"].last_move_s is not None and not svc.dirty


async def test_the_loop_serves_while_the_batch_is_written_and_a_node_that_left_meanwhile_gets_none():
    svc = service_with(4)
    svc.add_demand("tiny-gpt2")
    started, release = threading.Event(), threading.Event()
    write = svc.store.add_directives

    def slow_write(new, term=None):
        started.set()
        assert release.wait(5)
        return write(new, term=term)

    svc.store.add_directives = slow_write
    task = asyncio.create_task(rebalance_off_loop(svc))
    for _ in range(5000):  # bounded: 5 s
        if started.is_set() or task.done():
            break
        await asyncio.sleep(0.001)
    assert started.is_set(), "the batch write never started"
    svc.deregister("n3")  # on the loop, while the worker thread waits to write n3's move
    assert svc.dirty  # the leave asks for another round
    release.set()
    await task
    assert {(d.node_id, d.status, d.error) for d in svc.store.directives()} == {
        ("n3", "failed", "node left during the rebalance")}
    assert svc.dirty


@pytest.mark.parametrize(("failed_ago_s", "placed"), [(None, True), (10.0, False), (120.0, True)])
def test_a_node_whose_load_failed_within_the_cooldown_gets_no_placement(failed_ago_s, placed):
    svc = TrackerService(TrackerSettings(models=("tiny-llama",), load_failure_cooldown_s=60.0))
    svc.register(RegisterRequest.model_validate(registration("idle", "http://127.0.0.1:9100")))
    svc.set_reachability("idle", "http://127.0.0.1:9100", "")
    if failed_ago_s is not None:
        d = svc.queue_directive("idle", "LOAD_SHARD", model="tiny-llama", reason="earlier")
        svc.store.set_status(d.id, "failed", "out of memory")
        svc.store.db.execute("UPDATE directives SET updated_at = ? WHERE id = ?", (time.time() - failed_ago_s, d.id))
    rebalance(svc)
    loads = [d for d in svc.store.directives(statuses=("queued",)) if d.type == "LOAD_SHARD"]
    assert bool(loads) == placed


@pytest.mark.parametrize("count, lines", [
    (2, ["LOAD_SHARD m 0-9 → n0 (bootstrap)", "LOAD_SHARD m 0-9 → n1 (bootstrap)"]),
    (7000, ["rebalance queued 7000 loads (m 7000)"]),
])
def test_a_rebalance_logs_each_load_while_few_and_one_summary_at_scale(caplog, count, lines):
    from meshnet.layers import LayerRange
    from meshnet.tracker.placement import Assignment
    from meshnet.tracker.rebalance import _log_loads

    load = Assignment("m", LayerRange(0, 10), "bootstrap")
    with caplog.at_level("INFO", logger="meshnet.tracker.rebalance"):
        _log_loads(tuple((f"n{k}", load) for k in range(count)))
    assert [r.getMessage() for r in caplog.records] == lines
