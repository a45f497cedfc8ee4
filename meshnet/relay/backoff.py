"""Bounded, jittered retry delays (ADR-0045): reconnecting a tunnel, re-registering with a tracker.

Delay of attempt ``n`` (0-based) is drawn uniformly from ``[cap_n / 2, cap_n]`` with
``cap_n = min(max_s, base_s * 2**n)``: it doubles up to ``max_s`` and never exceeds it, and
the random half keeps many nodes that lost the same relay from reconnecting in lockstep.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Retry delays, seconds. ``reset()`` after a success starts again from ``base_s``.

    Attributes:
        base_s: the first delay's upper bound; ``max_s``: the bound no delay exceeds.
        rng: the random source (tests pass a seeded ``random.Random``).
    """

    base_s: float = 0.5
    max_s: float = 5.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s:
            raise ValueError(f"need 0 < base_s <= max_s, got {self.base_s} and {self.max_s}")

    def next_delay_s(self) -> float:
        """The delay before the next attempt, seconds; counts the attempt."""
        cap = min(self.max_s, self.base_s * 2 ** min(self.attempt, 32))
        self.attempt += 1
        return self.rng.uniform(cap / 2, cap)

    def reset(self) -> None:
        """A success: the next failure waits ``base_s`` at most again."""
        self.attempt = 0
