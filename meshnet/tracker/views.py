"""JSON views of tracker state for ``GET /v1/nodes`` and friends (what operators read)."""

from __future__ import annotations

import time

from meshnet.protocol.views import CapabilityView, NodeList, NodeView, ShardView
from meshnet.tracker import placement


def node_json(service, node, models, routed: dict, trusted: set[str]) -> NodeView:
    """One node: memory budget, ``max_assignable_layers`` per model of ``models`` (the tracked
    ModelInfos), slots, ranges with tier and admission (and the tokens/s routes count for each,
    from ``routed``: (node id, layers) -> tokens/s, :meth:`RoutesMixin.judged_speeds`), whether the
    tracker reached its endpoint (``reachable``, ``reach_error``), the placement reason, stats,
    heartbeat age, and whether it is in ``trusted`` (the operator's trusted node ids)."""
    now = time.monotonic()
    budget = placement.memory_budget_bytes(node.vram_bytes)
    max_layers = {}
    for m in models:
        per_layer = m.bytes_per_layer.get(node.quantization) or m.bytes_per_layer.get("bfloat16")
        if per_layer:
            # what its memory fits, at most the whole model
            max_layers[m.name] = min(m.num_layers, placement.max_assignable_layers(node.vram_bytes, per_layer))
    shards = []
    for s in node.shards:
        start, end = s.layers.to_inclusive()
        report = s.report
        capability = CapabilityView(stale=node.is_stale(report)) if report is None else CapabilityView(
            passed=report.passed, reason=report.reason, tokens_per_s=report.tokens_per_s,
            timestamp=report.timestamp, stale=node.is_stale(report))
        shards.append(ShardView(model=s.model, shard_start=start, shard_end=end, tier=s.tier,
                                quantization=s.quantization, entry=s.entry, weight_bytes=s.weight_bytes,
                                admitted=node.admitted(s), capability=capability,
                                verification=None if s.verdict is None else s.verdict.to_json(),
                                probed_tokens_per_s=node.probed_tokens_per_s(s),
                                claim_lost=routed.get((node.node_id, s.layers), node.tokens_per_s(s))
                                != node.tokens_per_s(s),
                                routed_tokens_per_s=routed.get((node.node_id, s.layers))))
    return NodeView(node_id=node.node_id, endpoint=node.endpoint, device=node.device, wallet=node.wallet,
                    vram_bytes=node.vram_bytes, memory_budget_bytes=budget, ram_bytes=node.ram_bytes,
                    quantization=node.quantization, max_assignable_layers=max_layers,
                    slots_used=len(node.shards), slots_total=node.max_loaded_shards, shards=shards,
                    accepts_placement=node.accepts_placement, draining=node.draining,
                    reachable=node.reachable, reach_error=node.reach_error,
                    reason=node.reason or service.plan_reasons.get(node.node_id, ""),
                    stats=node.stats, last_heartbeat_age_s=round(now - node.last_heartbeat_s, 1),
                    benchmark_tokens_per_sec=node.benchmark_tokens_per_sec,
                    quarantine=None if node.quarantine is None else node.quarantine.to_json(),
                    accusations=service.accusations.get(node.node_id), trusted=node.node_id in trusted)


def nodes_view(service) -> NodeList:
    """Every node, by id (``GET /v1/nodes``)."""
    models = service.tracked_models()  # one store read for the whole listing
    routed = {key: value for shards in service.admitted_by_model().values()  # one judgement per model
              for key, value in service.judged_speeds(shards).items()}
    trusted = service.store.trusted_nodes()
    return NodeList(nodes=[node_json(service, n, models, routed, trusted)
                           for n in sorted(service.nodes.values(), key=lambda n: n.node_id)])
