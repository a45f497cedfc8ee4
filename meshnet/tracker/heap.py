"""Short garbage-collector pauses for a tracker with a large heap (ADR-0059).

CPython's cyclic collector (3.11) runs a full, generation-2 collection whenever the objects that
reached the oldest generation since the last one outnumber a quarter of those already there, and a
full collection visits every tracked object while the event loop waits. A tracker of 10,000 nodes
holds millions of them (node records, shards, stats, keys), and its heartbeats keep replacing some,
so full collections recur: 60-200 ms each on the 2-core CI host, the longest pauses behind its
heartbeat p99 (``bench/heartbeats.py``, ADR-0059 has the figures).

:class:`HeapFreezer` moves what is alive into the collector's permanent generation
(:func:`gc.freeze`) every :data:`FREEZE_EVERY_S`, after a young collection, so full collections
only visit what was made since. Reference counting still frees frozen objects as usual; only
reference cycles among them wait, until :func:`gc.unfreeze` hands everything back to the
collector every :data:`THAW_EVERY_S` (one full-length collection then).
"""

from __future__ import annotations

import contextlib
import gc
import time

#: seconds between two freezes of the live heap
FREEZE_EVERY_S = 5.0
#: seconds between two thaws (the frozen heap handed back to the collector, so cycles among frozen
#: objects are collected at most this late)
THAW_EVERY_S = 600.0


class HeapFreezer:
    """Freeze the live heap every ``freeze_every_s`` and thaw it every ``thaw_every_s`` (seconds),
    as :meth:`tick` is called (the tracker's control loop: once a second)."""

    def __init__(self, freeze_every_s: float = FREEZE_EVERY_S, thaw_every_s: float = THAW_EVERY_S) -> None:
        self.freeze_every_s, self.thaw_every_s = freeze_every_s, thaw_every_s
        self.frozen_s = self.thawed_s = time.monotonic()

    def tick(self, now: float | None = None) -> str | None:
        """Freeze or thaw when due; returns ``"freeze"``, ``"thaw"`` or None (nothing due)."""
        now = time.monotonic() if now is None else now
        if now - self.thawed_s >= self.thaw_every_s:
            gc.unfreeze()
            self.thawed_s = self.frozen_s = now
            return "thaw"
        if now - self.frozen_s >= self.freeze_every_s:
            gc.collect(1)  # young garbage goes now, not into the permanent generation
            gc.freeze()
            self.frozen_s = now
            return "freeze"
        return None


@contextlib.contextmanager
def frozen_after():
    """Take in many long-lived objects at once (a tracker reading every shared record when it starts
    or takes over) without a full collection over them: the collector is off for the block, and what
    it made joins the permanent generation at its end, as :meth:`HeapFreezer.tick` would have moved it
    a few seconds later (10,000 records: the first sync round's longest block 73-76 -> about 30 ms).
    Young garbage made meanwhile waits for the next thaw (:data:`THAW_EVERY_S`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
