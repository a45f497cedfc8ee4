"""Several trackers on one database: leadership and the shared registry, once a second (ADR-0043, ADR-0054).

:func:`sync_round` runs at the top of every control-loop round. On sqlite it only confirms that
the tracker leads. On a shared store (PostgreSQL) it:

1. asks the store whether this tracker leads (:meth:`TrackerStore.lead`: takes or renews the
   lease, ADR-0054), waiting at most :data:`LEAD_WAIT_S` (a renewal that does not answer by then
   means standing by); a tracker that just took the lead reads every node record again, so its
   registry holds every node any tracker heard of, and plans at once;
2. writes the heartbeat times it collected since the last round, in one transaction;
3. reads the node records other trackers changed since the last round (plus a margin for
   writes that were in flight), the demand they counted, and which nodes have queued
   directives (so a heartbeat of a node with none reads nothing; a directive another tracker
   queues reaches its node at most one round later than it would from this one).

The store calls run on a worker thread; the service is changed on the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from meshnet.tracker.heap import frozen_after
from meshnet.tracker.routing import FAILURE_COOLDOWN_S
from meshnet.tracker.service import TrackerService

log = logging.getLogger(__name__)

#: records changed this long before the last read are read again (a write in flight then may
#: commit with an earlier time stamp), seconds
SYNC_MARGIN_S = 5.0


#: the longest a round waits for the lease renewal before standing by, seconds (well inside
#: the lease, :data:`meshnet.tracker.pgstore.LEASE_S`)
LEAD_WAIT_S = 2.0

#: other trackers' node records applied between two yields of the event loop: a tracker that starts
#: or takes over reads every record, and 10,000 of them held the loop 150-290 ms in one go (about 20 us
#: a record to parse, so a batch is about 2-3 ms). A request that becomes ready meanwhile runs after the
#: next batch, not the current one (``sleep(0)`` queues the round's continuation before it), so it waits
#: for up to two batches plus the rest of the loop: batches of 500 made that 35-60 ms, over the 50 ms
#: block target; 100 keep it near 10 ms
APPLY_BATCH = 100

#: the shortest time between two sync rounds, seconds (the control loop also wakes on every join)
SYNC_INTERVAL_S = 1.0


class Sharing:
    """The state of one tracker's sync with its database: when it last read node records.

    Args:
        service: the tracker's service.
        min_interval_s: a round sooner than this after the previous one does nothing (the
            control loop wakes on every registration; a storm of them must not become a storm
            of database rounds); tests pass 0.
    """

    def __init__(self, service: TrackerService, min_interval_s: float = SYNC_INTERVAL_S) -> None:
        self.service = service
        self.min_interval_s = min_interval_s
        self.read_at = 0.0  # unix time of the last read of changed records (0: read all)
        self.round_s = -min_interval_s  # monotonic time of the last round

    async def sync_round(self) -> bool:
        """One round (see the module); returns whether this tracker leads now (as of the last
        round, when this one comes too soon). Store errors propagate (the control loop logs them
        and tries again next round)."""
        svc, store = self.service, self.service.store
        if time.monotonic() - self.round_s < self.min_interval_s:
            return svc.leader
        self.round_s = time.monotonic()
        try:
            async with asyncio.timeout(LEAD_WAIT_S):  # not wait_for: it can swallow a cancel on 3.11
                leading = await asyncio.to_thread(store.lead)
        except asyncio.TimeoutError:
            log.warning("the lease renewal got no answer within %.1f s: standing by", LEAD_WAIT_S)
            leading = False
        if leading != svc.leader:
            svc.leader = leading
            if leading:
                log.warning("this tracker leads now: it plans and issues directives")
                self.read_at = 0.0  # every record again: nodes no tracker holds are dropped properly
                svc.dirty = True
            else:
                log.warning("this tracker no longer leads; it stands by (answers reads, registrations, heartbeats)")
        if not store.shared:
            return leading
        await svc.writes_done()  # this tracker's own demand and hop failures are in what it reads
        heartbeats = svc.take_heartbeats()
        since = max(0.0, self.read_at - SYNC_MARGIN_S) if self.read_at else 0.0
        read_at = time.time()
        svc.take_queued_since_read()
        try:
            rows, events, queued, quarantines, models, failures = await asyncio.to_thread(self._exchange, heartbeats,
                                                                                       since)
        except BaseException:
            self.read_at = 0.0  # changes were missed meanwhile (the database unreachable): read all next time
            svc.blind_until = math.inf
            raise
        self.read_at = read_at
        if svc.blind_until == math.inf:  # heartbeats other trackers heard meanwhile were not shared:
            svc.blind_until = time.monotonic() + svc.cadence().timeout_s  # no dropouts for one timeout
        svc.tracked_names |= set(models)
        svc.apply_quarantines(quarantines)
        with frozen_after() if len(rows) > APPLY_BATCH else contextlib.nullcontext():
            for start in range(0, len(rows), APPLY_BATCH):  # a tracker that starts or takes over reads them all
                svc.apply_rows(rows[start:start + APPLY_BATCH])
                if start + APPLY_BATCH < len(rows):
                    await asyncio.sleep(0)  # heartbeats are served between batches
        svc.apply_demand(events)
        svc.apply_hop_failures(failures)
        svc.queued_hint = set(queued) | svc.take_queued_since_read()
        return leading

    def _exchange(self, heartbeats: dict[str, float], since: float):
        """Worker thread: write the heartbeat times, read the changes (node records, demand, the nodes
        with queued directives, hop failures other trackers heard within their cooldown, and the
        quarantines and tracked models, small tables read whole)."""
        store, svc = self.service.store, self.service
        store.reconnect()
        store.touch_nodes(heartbeats)
        return (store.nodes_changed(since),
                store.demand_events(after_id=svc.demand_seen, since=time.time() - svc.settings.demand_window_s,
                                    not_from=svc.origin),
                store.nodes_with_queued(), store.quarantines(), store.models(),
                store.hop_failures(after_id=svc.hop_failures_seen, since=time.time() - FAILURE_COOLDOWN_S,
                                   not_from=svc.origin))
