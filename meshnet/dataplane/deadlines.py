"""Per-hop deadlines derived from the hop's own observed call times (docs/adr/0036-hop-deadlines.md).

The entry times every call it makes to a hop and keeps two bias-corrected moving averages
per hop: seconds per single-token call (a decode step) and seconds per token of multi-token
calls (prefill chunks, replays). A call's deadline is ``multiplier`` times what the hop
usually takes for that many tokens, never under ``floor_s``; before anything was observed it
is ``cold_s``. A call that misses its deadline is not yet a failure: the entry probes the
hop's ``/v1/health`` for ``probe_timeout_s``. A node that answers is slow but alive and is
given another deadline; one that does not is frozen and is failed over.

Pure numbers, no I/O: :func:`deadline_s` is table-tested. :class:`EMA`, the moving average the
hop timings, the node's batch window and its stats keep, lives here: it runs on every step.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Default EMA smoothing factor: weight of the newest sample (ADR-0013).
DEFAULT_ALPHA = 0.1


def _check_alpha(alpha: float) -> float:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return alpha


class EMA:
    """Exponential moving average of a plain value, bias-corrected as in Adam (ADR-0013).

    After samples ``x1..xn`` the raw average is ``m = sum(alpha * (1-alpha)**(n-i) * xi)``;
    it starts at 0 and so leans towards 0 early on. :attr:`value` divides by
    ``1 - (1-alpha)**n``, the weight the samples actually carry, so the first sample is
    reported as itself. Units are the caller's (meshnet uses it for latency in seconds).
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        self.alpha = _check_alpha(alpha)
        self._raw = 0.0
        self._decay = 1.0  # (1 - alpha) ** count
        self.count = 0

    def update(self, sample: float) -> float:
        """Add one sample; return the new :attr:`value`."""
        self._raw = self.alpha * sample + (1.0 - self.alpha) * self._raw
        self._decay *= 1.0 - self.alpha
        self.count += 1
        return self.value

    @property
    def value(self) -> float:
        """The bias-corrected average; 0.0 before any sample."""
        if self.count == 0:
            return 0.0
        return self._raw / (1.0 - self._decay)


@dataclass(frozen=True)
class DeadlinePolicy:
    """How long the entry waits for a hop call before it checks that the hop is alive.

    Attributes:
        floor_s: the shortest deadline, seconds (0.5). Jitter of a loaded CPU, a GC pause or a
            step queued behind another session's work on the node stays under it.
        multiplier: deadline over the expected call time (4): a node serialises its sessions'
            steps, so a step may wait behind about three others before it looks slow.
        cold_s: deadline of a call to a hop with nothing observed yet, seconds (2.0): a first
            call also pays the connection and the node's first-forward warm-up.
        probe_timeout_s: how long a liveness probe (``GET /v1/health``) may take, seconds (0.5).
            The health handler runs no compute, so a live node answers in milliseconds even
            while a forward runs in its worker thread; a stopped process never does.
        ema_alpha: weight of the newest observation in the moving averages (0.1, as in a
            throughput EMA: about the last ten calls count).

    Raises:
        ValueError: a non-positive time, ``multiplier`` under 1, ``cold_s`` under ``floor_s`` or
            ``ema_alpha`` outside (0, 1].
    """

    floor_s: float = 0.5
    multiplier: float = 4.0
    cold_s: float = 2.0
    probe_timeout_s: float = 0.5
    ema_alpha: float = 0.1

    def __post_init__(self) -> None:
        if min(self.floor_s, self.cold_s, self.probe_timeout_s) <= 0:
            raise ValueError("hop deadline times must be > 0")
        if self.multiplier < 1 or self.cold_s < self.floor_s or not 0 < self.ema_alpha <= 1:
            raise ValueError(f"invalid hop deadline policy: {self}")


class StepTimes:
    """What one hop took so far: a decode step (seconds per single-token call), a prefill token
    (seconds per token of multi-token calls), and the longest multi-token call (seconds)."""

    def __init__(self, alpha: float = DeadlinePolicy.ema_alpha) -> None:
        self._step = EMA(alpha)  # bias-corrected (ADR-0013): the first observation is taken as is
        self._token = EMA(alpha)
        self.longest_chunk_s: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one successful call of ``tokens`` tokens that took ``seconds``."""
        if tokens <= 1:
            self._step.update(seconds)
        else:
            self._token.update(seconds / tokens)
            self.longest_chunk_s = max(seconds, self.longest_chunk_s or 0.0)

    @property
    def step_s(self) -> float | None:
        return self._step.value if self._step.count else None

    @property
    def token_s(self) -> float | None:
        return self._token.value if self._token.count else None


def expected_s(times: StepTimes, tokens: int) -> float | None:
    """Seconds a call of ``tokens`` tokens usually takes on this hop (None: nothing to go by).

    A single token: the decode step average, else the longest chunk seen (one token costs no
    more than a whole chunk on the same node). Several: tokens × the per-token average of
    chunks, else tokens × the decode step (a chunk costs no more than as many single steps).
    """
    if tokens <= 1:
        return times.step_s if times.step_s is not None else times.longest_chunk_s
    per_token = times.token_s if times.token_s is not None else times.step_s
    return None if per_token is None else tokens * per_token


def deadline_s(policy: DeadlinePolicy, times: StepTimes, tokens: int) -> float:
    """Seconds to wait for a call of ``tokens`` tokens before probing the hop:
    ``max(floor_s, multiplier × expected)``, or ``cold_s`` when nothing was observed."""
    expected = expected_s(times, tokens)
    if expected is None:
        return policy.cold_s
    return max(policy.floor_s, policy.multiplier * expected)
