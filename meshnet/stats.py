"""Small statistics utilities for node and tracker bookkeeping (docs/adr/0013-node-stats.md).

- :class:`PerformanceEMA`: throughput of a node, tokens/s, as a bias-corrected EMA.
- :class:`EMA`: a plain value such as hop latency in seconds, bias-corrected (defined with the
  hop deadlines it times, :mod:`meshnet.dataplane.deadlines`, and used here).
- :class:`RollingCounter`: events per minute over a sliding window (requests per minute).
- :class:`TimeBuckets`: count, sum and max of named series in fixed time buckets over the last
  minutes (the traffic history the console draws as sparklines, ADR-0046).

Every method that depends on time takes an optional ``now`` (seconds, from
``time.monotonic`` when omitted) so tests are deterministic. No I/O.
"""

from __future__ import annotations

import time
from collections import deque

from meshnet.dataplane.deadlines import DEFAULT_ALPHA, EMA

__all__ = ["EMA", "PerformanceEMA", "RollingCounter", "TimeBuckets", "BucketStat"]

#: Default sliding window of :class:`RollingCounter`, seconds (ADR-0013).
DEFAULT_WINDOW_S = 60.0


class PerformanceEMA:
    """Throughput in tokens/s as a bias-corrected EMA, the shape hivemind uses (ADR-0013).

    The average is taken over seconds per token (each sample ``seconds / n_tokens``) and
    inverted on read, so a long slow batch and a short fast one weigh by what they say
    about the time a token takes, not by their rate. Bias correction as in :class:`EMA`.
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        self._seconds_per_token = EMA(alpha)

    @property
    def alpha(self) -> float:
        return self._seconds_per_token.alpha

    @property
    def count(self) -> int:
        """Samples taken so far."""
        return self._seconds_per_token.count

    def update(self, n_tokens: float, seconds: float) -> float:
        """Record ``n_tokens`` processed in ``seconds``; return the new tokens/s.

        Raises:
            ValueError: if ``n_tokens <= 0`` or ``seconds <= 0``.
        """
        if n_tokens <= 0 or seconds <= 0:
            raise ValueError(f"need n_tokens > 0 and seconds > 0, got {n_tokens} tokens in {seconds} s")
        self._seconds_per_token.update(seconds / n_tokens)
        return self.value

    @property
    def value(self) -> float:
        """Estimated throughput, tokens/s; 0.0 before any sample."""
        seconds_per_token = self._seconds_per_token.value
        return 1.0 / seconds_per_token if seconds_per_token > 0 else 0.0


class RollingCounter:
    """Events per minute over a sliding window of ``window_s`` seconds (ADR-0013).

    An event at time ``t`` counts while ``now - window_s < t <= now``. Timestamps are
    kept in a deque and pruned on every call, so memory holds only the events inside one
    window. Times are seconds on a monotonic clock and must not go backwards.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._events: deque[float] = deque()

    def add(self, t: float | None = None) -> None:
        """Record one event at time ``t`` (seconds; now when omitted)."""
        t = time.monotonic() if t is None else t
        self._events.append(t)
        self._prune(t)

    def count(self, now: float | None = None) -> int:
        """Events inside the window ending at ``now``."""
        now = time.monotonic() if now is None else now
        self._prune(now)
        if not self._events or self._events[-1] <= now:
            return len(self._events)
        return sum(1 for t in self._events if t <= now)  # asked about a moment before the last add

    def per_minute(self, now: float | None = None) -> float:
        """Event rate over the window ending at ``now``, events per minute."""
        return self.count(now) * 60.0 / self.window_s

    def __len__(self) -> int:
        """Timestamps held (the memory bound), not a rate."""
        return len(self._events)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._events and self._events[0] <= horizon:
            self._events.popleft()


class BucketStat:
    """Count, sum and max of the samples of one series in one bucket (max is 0.0 while empty)."""

    __slots__ = ("count", "total", "max")

    def __init__(self, count: int = 0, total: float = 0.0, largest: float = 0.0) -> None:
        self.count, self.total, self.max = count, total, largest

    @property
    def mean(self) -> float | None:
        """Mean of the samples, None when there are none."""
        return self.total / self.count if self.count else None

    def add(self, value: float) -> None:
        self.max = value if self.count == 0 else max(self.max, value)
        self.count += 1
        self.total += value

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BucketStat)
                and (self.count, self.total, self.max) == (other.count, other.total, other.max))

    def __repr__(self) -> str:
        return f"BucketStat(count={self.count}, total={self.total}, max={self.max})"


class TimeBuckets:
    """Samples of named series folded into buckets of ``bucket_s`` seconds, the last ``count`` kept.

    Bucket ``i`` holds the samples with ``i * bucket_s <= t < (i + 1) * bucket_s``: buckets are
    aligned to multiples of ``bucket_s`` on the clock the times come from (wall-clock seconds for
    the traffic history, so two nodes' buckets line up). Memory is bounded by ``count`` buckets
    times the series used; older buckets are dropped on every :meth:`add`. A sample more than
    ``count`` buckets older than the newest one is ignored.

    Raises:
        ValueError: ``bucket_s <= 0`` or ``count < 1``.
    """

    def __init__(self, bucket_s: float = 10.0, count: int = 60) -> None:
        if bucket_s <= 0 or count < 1:
            raise ValueError(f"bucket_s must be > 0 and count >= 1, got {bucket_s} and {count}")
        self.bucket_s, self.count = bucket_s, count
        self._buckets: dict[int, dict[str, BucketStat]] = {}
        self._newest = None

    def index(self, t: float) -> int:
        """The bucket of time ``t`` (seconds)."""
        return int(t // self.bucket_s)

    def add(self, series: str, value: float, t: float | None = None) -> None:
        """Record ``value`` of ``series`` at time ``t`` (seconds; ``time.time()`` when omitted)."""
        i = self.index(time.time() if t is None else t)
        if self._newest is not None and i <= self._newest - self.count:
            return
        self._buckets.setdefault(i, {}).setdefault(series, BucketStat()).add(value)
        if self._newest is None or i > self._newest:
            self._newest = i
            for old in [k for k in self._buckets if k <= i - self.count]:
                del self._buckets[old]

    def window(self, now: float) -> list[int]:
        """The ``count`` bucket indexes ending with the one holding ``now``, oldest first."""
        last = self.index(now)
        return list(range(last - self.count + 1, last + 1))

    def stat(self, series: str, index: int) -> BucketStat:
        """The samples of ``series`` in bucket ``index`` (an empty stat when there are none)."""
        return self._buckets.get(index, {}).get(series) or BucketStat()

    def copy(self) -> "TimeBuckets":
        """An independent copy (to fold more samples into without touching this one)."""
        out = TimeBuckets(self.bucket_s, self.count)
        out._newest = self._newest
        out._buckets = {i: {k: BucketStat(s.count, s.total, s.max) for k, s in series.items()}
                        for i, series in self._buckets.items()}
        return out
