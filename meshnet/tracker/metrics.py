"""Tracker metrics (prometheus-client, per-app registry, ``meshnet_`` prefix, unit suffixes)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


class TrackerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("meshnet_tracker_chat_requests", "chat requests forwarded", ["model"],
                                registry=self.registry)
        self.nodes = Gauge("meshnet_nodes", "registered nodes", registry=self.registry)
        self.covered = Gauge("meshnet_covered_layers", "layers with at least one admitted shard", ["model"],
                             registry=self.registry)
        self.running = Gauge("meshnet_requests_running", "in-flight requests reported by nodes",
                             registry=self.registry)
        self.relayed_nodes = Gauge("meshnet_relayed_nodes", "registered nodes reached through a relay (ADR-0045)",
                                   registry=self.registry)
        self.node_tokens_per_s = Gauge("meshnet_node_tokens_per_second", "node decode throughput EMA",
                                       ["node"], registry=self.registry)
        self.quarantined = Gauge("meshnet_quarantined_nodes", "nodes in quarantine (ADR-0042, ADR-0067)",
                                 registry=self.registry)
        self.accusations = Gauge("meshnet_accusations", "entries' audit accusations by the tracker's judgement "
                                 "(upheld, false, forged), summed over entries (ADR-0067)", ["outcome"],
                                 registry=self.registry)
        self.audit_verdicts = Counter("meshnet_audit_verdicts", "audit disputes this tracker judged, by verdict "
                                      "(ADR-0067)", ["verdict"], registry=self.registry)

    def render(self, service) -> tuple[bytes, str]:
        self.nodes.set(len(service.nodes))
        self.running.set(sum(n.stats.requests_running for n in service.nodes.values()))
        self.relayed_nodes.set(sum(1 for n in service.nodes.values() if n.relay_url))
        for m in service.tracked_models():
            self.covered.labels(model=m.name).set(service.coverage(m.name).covered_layers)
        for n in service.nodes.values():
            self.node_tokens_per_s.labels(node=n.node_id).set(n.stats.tokens_per_s)
        self.quarantined.set(len(service.quarantined))
        for outcome in ("upheld", "false", "forged"):
            self.accusations.labels(outcome=outcome).set(sum(c.get(outcome, 0) for c in service.accusations.values()))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
