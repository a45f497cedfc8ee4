"""Node metrics (prometheus-client, per-app registry, ``meshnet_`` prefix, unit suffixes) and
the stats a node reports in heartbeats (ADR-0013).

Metric names follow the serving convention of time to first token, time per output
token, token totals and requests running. The same observations also go into a short
wall-clock history (:class:`meshnet.stats.TimeBuckets`) that ``GET /v1/traffic`` serves
as :class:`meshnet.protocol.traffic.TrafficBucket` rows (ADR-0046).

The per-token hot path only appends a tuple to a deque (``record``, a C call: no Python frame
per token, ADR-0051) and bumps plain integer counters; every reader folds what was appended into
the series, EMAs and history first (:meth:`NodeMetrics.fold`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from meshnet.protocol.control import NodeStats
from meshnet.protocol.traffic import BUCKET_COUNT, BUCKET_S, TrafficBucket
from meshnet.stats import EMA, PerformanceEMA, RollingCounter, TimeBuckets

#: observations kept between two reads (heartbeats, scrapes); older ones are dropped past it
PENDING_MAX = 1 << 16
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 5)


class NodeMetrics:
    """Prometheus series of one node plus the EMAs and counters its heartbeats carry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        #: the entry's audit counts (:class:`meshnet.gateway.audit.AuditStats`), set when its auditor starts
        self.audit_stats = None
        r.register(_AuditCollector(self))
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
        self.batch_size = Histogram("meshnet_node_batch_size", "steps (sessions) run by one forward of this node",
                                    buckets=_BATCH_BUCKETS, registry=r)
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
        #: wall-clock history of ttft_s, tpot_s and forward_tokens for the traffic view
        self.recent = TimeBuckets(BUCKET_S, BUCKET_COUNT)
        self.clock = time.time  #: wall clock of that history (tests pin it)
        #: the hot path's observations, folded by :meth:`fold`: ``record((tokens, seconds, position,
        #: wall-clock s, monotonic s))`` (one forward) and ``record_batch(steps)`` are bound ``deque.append``s
        self.pending: collections.deque[tuple] = collections.deque(maxlen=PENDING_MAX)
        self.record = self.pending.append
        self.batches: collections.deque[int] = collections.deque(maxlen=PENDING_MAX)
        self.record_batch = self.batches.append
        #: hop stream messages and bytes by direction, counted in place: this node's ``/v1/stream``
        #: (``served``) and the transports registered with :meth:`count_streams`
        self.served_streams = {"in": [0, 0], "out": [0, 0]}
        self._stream_counts: list[dict[str, list[int]]] = [self.served_streams]
        self._streams_folded: dict[tuple[int, str], tuple[int, int]] = {}

    def observe_forward(self, n_tokens: int, seconds: float, position: int) -> None:
        """One forward of ``n_tokens`` tokens taking ``seconds``, the first at ``position``."""
        self.record((n_tokens, seconds, position, self.clock(), time.monotonic()))

    def observe_batch(self, steps: int) -> None:
        """One forward run of ``steps`` sessions' steps (thread-safe: called from the compute thread)."""
        self.record_batch(steps)

    def count_streams(self, counts: dict[str, list[int]]) -> None:
        """Export a transport's ``{"in"|"out": [messages, bytes]}`` counters (see
        :attr:`meshnet.dataplane.transport.StreamPool.traffic`)."""
        self._stream_counts.append(counts)

    def fold(self) -> None:
        """Fold the observations the hot path appended into the series, EMAs and history."""
        pending, batches = self.pending, self.batches
        while pending:
            n_tokens, seconds, position, at, monotonic_at = pending.popleft()
            self.tokens.inc(n_tokens)
            self.recent.add("forward_tokens", n_tokens, at)
            self.forward_seconds.observe(seconds)
            if position == 0:
                self.session_rate.add(monotonic_at)
            if n_tokens == 1 and seconds > 0:
                self.tokens_per_s.update(1, seconds)
                self.decode_latency_s.update(seconds)
        while batches:
            self.batch_size.observe(batches.popleft())
        for counts in self._stream_counts:
            for direction, (messages, nbytes) in counts.items():
                seen = self._streams_folded.get((id(counts), direction), (0, 0))
                self.stream_messages.labels(direction).inc(messages - seen[0])
                self.stream_bytes.labels(direction).inc(nbytes - seen[1])
                self._streams_folded[(id(counts), direction)] = (messages, nbytes)

    def generation_started(self) -> None:
        self.requests_total += 1
        self.requests_running += 1
        self.requests.inc()
        self.running.inc()

    def first_token(self, seconds: float) -> None:
        """Time from a request's arrival to its first token handed to the client (streamed or not)."""
        self.ttft.observe(seconds)
        self.recent.add("ttft_s", seconds, self.clock())

    def generation_finished(self, stats) -> None:
        """Record one finished generation's GenerationStats."""
        self.requests_running -= 1
        self.running.dec()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(stats.completion_tokens)
        if stats.completion_tokens > 1 and stats.decode_s > 0:
            tpot_s = stats.decode_s / (stats.completion_tokens - 1)
            self.tpot.observe(tpot_s)
            self.recent.add("tpot_s", tpot_s, self.clock())

    def traffic_buckets(self, batch_sizes: Iterable[tuple[float, int]], *, now_s: float | None = None,
                        monotonic_s: float | None = None) -> list[TrafficBucket]:
        """The last :data:`BUCKET_COUNT` buckets of this node's traffic, oldest first, ending with the
        one holding ``now_s`` (wall-clock seconds; now when omitted).

        ``batch_sizes``: ``(monotonic seconds, sessions in one forward)`` samples (the runtime's
        ``batch_sizes``), placed on the wall clock by their age at ``monotonic_s`` (now when omitted).
        """
        self.fold()
        now_s = self.clock() if now_s is None else now_s
        monotonic_s = time.monotonic() if monotonic_s is None else monotonic_s
        history = self.recent.copy()
        for t, size in list(batch_sizes):
            history.add("batch_size", size, now_s - (monotonic_s - t))
        rows = []
        for i in history.window(now_s):
            ttft, tpot, batch = history.stat("ttft_s", i), history.stat("tpot_s", i), history.stat("batch_size", i)
            rows.append(TrafficBucket(
                start_s=i * history.bucket_s, ttft_s=_rounded(ttft.mean), first_tokens=ttft.count,
                tpot_s=_rounded(tpot.mean), finished=tpot.count,
                forward_tokens=int(history.stat("forward_tokens", i).total),
                batch_size=None if batch.mean is None else round(batch.mean, 3), batch_size_max=int(batch.max),
                forwards=batch.count))
        return rows

    def update_gauges(self, runtime, chains: int = 0) -> None:
        self.fold()
        self.sessions.set(len(runtime.sessions))
        self.chains.set(chains)
        self.cache_bytes_left.set(runtime.sessions.bytes_left)

    def heartbeat_stats(self, runtime, rss_bytes: int = 0) -> NodeStats:
        """Stats for the tracker (ADR-0013), see :class:`meshnet.protocol.control.NodeStats`."""
        self.fold()
        return NodeStats(tokens_per_s=round(self.tokens_per_s.value, 3),
                         decode_latency_s=round(self.decode_latency_s.value, 5),
                         requests_per_min=round(self.session_rate.per_minute(), 3), sessions=len(runtime.sessions),
                         requests_running=self.requests_running, requests_total=self.requests_total,
                         cache_bytes_left=runtime.sessions.bytes_left, tokens_processed=runtime.tokens_processed,
                         rss_bytes=rss_bytes)

    def render(self) -> tuple[bytes, str]:
        self.fold()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


#: the outcomes of :class:`meshnet.gateway.audit.AuditStats` that ``meshnet_entry_audits_total`` counts
AUDIT_OUTCOMES = ("passed", "disputes", "withheld", "rebuilt", "unverified", "mismatched", "unsigned")


class _AuditCollector:
    """``meshnet_entry_audits_total{outcome}``: the hops this entry audited (ADR-0067), by outcome, read
    from its auditor's counts at each scrape (nothing before the auditor starts)."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.audit_stats
        if stats is None:
            return
        family = CounterMetricFamily("meshnet_entry_audits", "hops this entry audited, by outcome (ADR-0067)",
                                     labels=["outcome"])
        for outcome in AUDIT_OUTCOMES:
            family.add_metric([outcome], getattr(stats, outcome))
        yield family
