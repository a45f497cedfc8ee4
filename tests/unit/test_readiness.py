"""Readiness decisions (node and tracker) as pure functions, table-driven (ADR-0032)."""

from __future__ import annotations

import pytest

from meshnet.node.readiness import NodeFacts, ShardFact, TrackerFact, node_readiness
from meshnet.tracker.readiness import tracker_readiness

URL = "http://tracker:8700"
ENTRY = ShardFact("m", 0, 9, True, True)
MIDDLE = ShardFact("m", 10, 19, False, True)
OK_LINK = TrackerFact(URL, heartbeat_age_s=3.0, timeout_s=25.0)


@pytest.mark.parametrize("facts, reasons", [
    (NodeFacts(False, [MIDDLE], OK_LINK), []),
    (NodeFacts(False, [ENTRY], OK_LINK), []),
    (NodeFacts(True, [MIDDLE], OK_LINK), ["draining: the node is shutting down and takes no new sessions"]),
    (NodeFacts(False, [], OK_LINK), ["no shard loaded"]),
    (NodeFacts(False, [ShardFact("m", 10, 19, False, False, "logits mismatch")], OK_LINK),
     ["shard m 10-19: capability check failed: logits mismatch"]),
    (NodeFacts(False, [MIDDLE], TrackerFact(URL, 3.0, "heartbeat: cannot reach http://tracker:8700: ConnectError")),
     [f"tracker {URL} unreachable: heartbeat: cannot reach http://tracker:8700: ConnectError"]),
    (NodeFacts(False, [MIDDLE], TrackerFact(URL, None)), [f"not registered with tracker {URL} yet"]),
    (NodeFacts(False, [MIDDLE], TrackerFact(URL, 40.0, timeout_s=25.0)),
     [f"tracker {URL} has not accepted a heartbeat for 40 s"]),
    (NodeFacts(False, [ShardFact("m", 0, 9, True, True, route_error="model m is not routable yet")], OK_LINK),
     ["m: no route for the layers after 9: model m is not routable yet"]),
    (NodeFacts(False, [ENTRY], TrackerFact(None), {"m": 30}),
     ["m: standalone entry holds layers 0-9 of 30 and has no tracker to route the rest"]),
    (NodeFacts(False, [ShardFact("m", 0, 29, True, True)], TrackerFact(None), {"m": 30}), []),
    (NodeFacts(False, [MIDDLE], TrackerFact(None)), []),
])
def test_node_readiness(facts, reasons):
    assert node_readiness(facts) == {"ready": not reasons, "reasons": reasons}


def cov(model: str, *segments: tuple[int, int, int], routable: bool | None = None) -> dict:
    segs = [{"start_layer": a, "end_layer": b, "node_count": n} for a, b, n in segments]
    return {"model": model, "segments": segs,
            "routable": all(n for _, _, n in segments) if routable is None else routable}


@pytest.mark.parametrize("coverages, draining, ready, reasons", [
    ([cov("m", (0, 29, 1))], False, True, []),
    ([cov("m", (0, 9, 1), (10, 19, 0), (20, 29, 2))], False, False,
     ["m: coverage gap at layers 10-19 (no admitted node serves them)"]),
    ([cov("m", (0, 29, 1), routable=False)], False, False,
     ["m: no admitted entry node (one serving layer 0 with the embeddings)"]),
    ([cov("m", (0, 29, 1)), cov("asked-for", (0, 3, 0))], False, True, []),  # one routable model is enough
    ([cov("m", (0, 29, 1))], True, False, ["draining: the tracker is shutting down and takes no new chats"]),
    ([], False, False, ["no model is tracked (start the tracker with --model, or start a node with a shard)"]),
])
def test_tracker_readiness(coverages, draining, ready, reasons):
    body = tracker_readiness(coverages, draining=draining)
    assert (body["ready"], body["reasons"]) == (ready, reasons)
    assert [m["model"] for m in body["models"]] == [c["model"] for c in coverages]
