"""Connection state of the console towards its tracker, and the polling back-off.

Pure and clock-free: every method that needs the time takes ``now`` (seconds from the
console's clock). The app asks :attr:`Connection.next_interval_s` how long to wait before
the next poll and :meth:`badge` what the top bar should say; ``record_*`` return whether
the state *changed*, which is the only time the console shows a toast.
"""

from __future__ import annotations

from dataclasses import dataclass

from tui.format import format_age

#: cap of the exponential back-off while the tracker is unreachable
BACKOFF_CAP_S = 30.0


def backoff_interval_s(base_s: float, failures: int, cap_s: float = BACKOFF_CAP_S) -> float:
    """``base_s`` while healthy, then ``base_s * 2**failures`` capped at ``cap_s``."""
    if failures <= 0:
        return base_s
    return min(cap_s, base_s * 2 ** min(failures, 16))


@dataclass
class Connection:
    """Whether the tracker answered the last poll, since when, and what went wrong.

    Attributes:
        base_interval_s: polling period while connected.
        connected: ``None`` until the first poll finishes.
        last_ok_s: console clock of the last successful poll (``None``: never).
        failures: consecutive failed polls (drives the back-off).
        error: message of the last failure.
    """

    base_interval_s: float = 2.0
    cap_s: float = BACKOFF_CAP_S
    connected: bool | None = None
    last_ok_s: float | None = None
    failures: int = 0
    error: str = ""

    @property
    def next_interval_s(self) -> float:
        return backoff_interval_s(self.base_interval_s, self.failures, self.cap_s)

    @property
    def stale(self) -> bool:
        """True when what the console shows may be out of date (last poll failed)."""
        return self.connected is False

    def record_ok(self, now: float) -> bool:
        """A poll succeeded; returns True if this is a change of state (was unreachable)."""
        changed = self.connected is False
        self.connected, self.last_ok_s, self.failures, self.error = True, now, 0, ""
        return changed

    def record_failure(self, error: str, now: float) -> bool:
        """A poll failed; returns True if this is a change of state (first failure)."""
        changed = self.connected is not False
        self.connected, self.error = False, error
        self.failures += 1
        return changed

    def badge(self, now: float) -> str:
        """``● connected``, ``✕ unreachable, last ok 12 s ago``, or ``… connecting``."""
        if self.connected is None:
            return "… connecting"
        if self.connected:
            return "● connected"
        if self.last_ok_s is None:
            return "✕ unreachable, never connected"
        return f"✕ unreachable, last ok {format_age(now - self.last_ok_s)} ago"
