"""Node metrics (prometheus-client, per-app registry, ``meshnet_`` prefix, unit suffixes)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from meshnet.stats import PerformanceEMA


class NodeMetrics:
    """Counters and gauges of one node, plus the tokens/s EMA reported in heartbeats."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("meshnet_chat_requests", "chat requests served as entry node",
                                registry=self.registry)
        self.tokens = Counter("meshnet_forward_tokens", "tokens run through this node's layers",
                              registry=self.registry)
        self.forward_seconds = Histogram("meshnet_forward_seconds", "time of one forward call",
                                         registry=self.registry)
        self.sessions = Gauge("meshnet_sessions", "live KV-cache sessions", registry=self.registry)
        self.cache_bytes_left = Gauge("meshnet_cache_left_bytes", "KV-cache space left", registry=self.registry)
        self.running = Gauge("meshnet_requests_running", "chat requests in flight", registry=self.registry)
        self.tokens_per_s = PerformanceEMA(alpha=0.1)
        self.in_flight = 0

    def observe_forward(self, n_tokens: int, seconds: float) -> None:
        self.tokens.inc(n_tokens)
        self.forward_seconds.observe(seconds)
        self.tokens_per_s.update(n_tokens, seconds)

    def update_gauges(self, runtime) -> None:
        self.sessions.set(len(runtime.sessions))
        self.cache_bytes_left.set(runtime.sessions.bytes_left)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
