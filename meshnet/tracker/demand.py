"""Demand and load counted per model over a window (part of :class:`meshnet.tracker.service.TrackerService`).

Refused requests (a model not routable) are queued demand that placement answers; served ones
are load that earns redundancy (DESIGN: placement where demand appears). Both are stored, so they
survive a restart and reach every tracker of a shared store (ADR-0043).
"""

from __future__ import annotations

import logging
import time

from meshnet.tracker.tables import DemandEvent

log = logging.getLogger(__name__)


class DemandMixin:
    """Demand and load rates of :class:`TrackerService` (which provides ``demand``, ``served``,
    ``store``, ``settings``, ``origin``, ``demand_seen``, ``dirty`` and ``write_soon``)."""

    def apply_demand(self, events: list[DemandEvent], now: float | None = None) -> None:
        """Count demand events other trackers stored (or this one, before a restart)."""
        now = time.monotonic() if now is None else now
        wall = time.time()
        for e in events:
            target = self.demand if e.kind == "refused" else self.served
            target.setdefault(e.model, []).append(now - max(0.0, wall - e.at))
            self.demand_seen = max(self.demand_seen, e.id)
        if any(e.kind == "refused" for e in events):
            self.dirty = True

    def _count(self, model: str, kind: str, now: float | None) -> None:
        target = self.demand if kind == "refused" else self.served
        target.setdefault(model, []).append(time.monotonic() if now is None else now)
        self.write_soon(f"demand for {model}", self.store.add_demand_event,
                        DemandEvent(model, kind, time.time(), self.origin))

    def add_demand(self, model: str, now: float | None = None) -> None:
        """Count a request refused because ``model`` was not routable (queued demand); stored, so it
        survives a restart and reaches the other trackers of a shared store."""
        self._count(model, "refused", now)
        self.track_model(model, source="demand")
        self.dirty = True

    def add_served(self, model: str, now: float | None = None) -> None:
        """Count a request forwarded to an entry node (the load that earns redundancy); stored."""
        self._count(model, "served", now)

    def _rate(self, events: dict[str, list[float]], model: str, now: float | None) -> float:
        now = time.monotonic() if now is None else now
        window = self.settings.demand_window_s
        kept = [t for t in events.get(model, []) if now - t <= window]
        events[model] = kept
        return len(kept) * 60.0 / window

    def demand_rate(self, model: str, now: float | None = None) -> float:
        """Queued demand for ``model``: refused requests per minute over the demand window."""
        return self._rate(self.demand, model, now)

    def load_rate(self, model: str, now: float | None = None) -> float:
        """All requests per minute for ``model`` (served plus refused) over the demand window."""
        return self._rate(self.served, model, now) + self.demand_rate(model, now)
