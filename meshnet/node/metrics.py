"""Node metrics (prometheus-client, per-app registry, ``meshnet_`` prefix, unit suffixes) and
the stats a node reports in heartbeats (ADR-0013).

Metric names follow the serving convention of time to first token, time per output
token, token totals and requests running.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from meshnet.protocol.control import NodeStats
from meshnet.stats import EMA, PerformanceEMA, RollingCounter

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class NodeMetrics:
    """Prometheus series of one node plus the EMAs and counters its heartbeats carry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("meshnet_chat_requests", "chat requests served as entry node", registry=r)
        self.running = Gauge("meshnet_requests_running", "generations in flight on this entry node", registry=r)
        self.ttft = Histogram("meshnet_time_to_first_token_seconds",
                              "request arrival to the first token handed to the client",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("meshnet_time_per_output_token_seconds", "decode seconds per generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("meshnet_prompt_tokens", "prompt tokens prefilled as entry node", registry=r)
        self.completion_tokens = Counter("meshnet_generation_tokens", "tokens generated as entry node", registry=r)
        self.tokens = Counter("meshnet_forward_tokens", "tokens run through this node's layers", registry=r)
        self.forward_seconds = Histogram("meshnet_forward_seconds", "time of one forward call",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.sessions = Gauge("meshnet_sessions", "live KV-cache sessions", registry=r)
        self.cache_bytes_left = Gauge("meshnet_cache_left_bytes", "KV-cache space left", registry=r)
        self.stream_messages = Counter("meshnet_stream_messages", "hop stream messages (ADR-0040) by direction",
                                       ["direction"], registry=r)
        self.stream_bytes = Counter("meshnet_stream_bytes", "hop stream message bytes (headers and frames) by direction",
                                    ["direction"], registry=r)
        self.chains = Gauge("meshnet_chains", "chains whose hop runs on this node now", registry=r)
        #: decode throughput of this node's layers (single-token forwards only), tokens/s
        self.tokens_per_s = PerformanceEMA(alpha=0.1)
        #: seconds of one single-token forward call on this node
        self.decode_latency_s = EMA(alpha=0.1)
        #: sessions started here per minute (requests through this node)
        self.session_rate = RollingCounter(window_s=60.0)
        #: generations driven as entry node: running now, and since start (what the gauges show)
        self.requests_running = 0
        self.requests_total = 0

    def observe_forward(self, n_tokens: int, seconds: float, position: int) -> None:
        self.tokens.inc(n_tokens)
        self.forward_seconds.observe(seconds)
        if position == 0:
            self.session_rate.add()
        if n_tokens == 1 and seconds > 0:
            self.tokens_per_s.update(1, seconds)
            self.decode_latency_s.update(seconds)

    def observe_stream(self, direction: str, nbytes: int) -> None:
        """One hop stream message of ``nbytes`` bytes, ``direction`` ``"in"`` or ``"out"``."""
        self.stream_messages.labels(direction).inc()
        self.stream_bytes.labels(direction).inc(nbytes)

    def generation_started(self) -> None:
        self.requests_total += 1
        self.requests_running += 1
        self.requests.inc()
        self.running.inc()

    def first_token(self, seconds: float) -> None:
        """Time from a request's arrival to its first token handed to the client (streamed or not)."""
        self.ttft.observe(seconds)

    def generation_finished(self, stats) -> None:
        """Record one finished generation's GenerationStats."""
        self.requests_running -= 1
        self.running.dec()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(stats.completion_tokens)
        if stats.completion_tokens > 1 and stats.decode_s > 0:
            self.tpot.observe(stats.decode_s / (stats.completion_tokens - 1))

    def update_gauges(self, runtime, chains: int = 0) -> None:
        self.sessions.set(len(runtime.sessions))
        self.chains.set(chains)
        self.cache_bytes_left.set(runtime.sessions.bytes_left)

    def heartbeat_stats(self, runtime, rss_bytes: int = 0) -> NodeStats:
        """Stats for the tracker (ADR-0013), see :class:`meshnet.protocol.control.NodeStats`."""
        return NodeStats(tokens_per_s=round(self.tokens_per_s.value, 3),
                         decode_latency_s=round(self.decode_latency_s.value, 5),
                         requests_per_min=round(self.session_rate.per_minute(), 3), sessions=len(runtime.sessions),
                         requests_running=self.requests_running, requests_total=self.requests_total,
                         cache_bytes_left=runtime.sessions.bytes_left, tokens_processed=runtime.tokens_processed,
                         rss_bytes=rss_bytes)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
