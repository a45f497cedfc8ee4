"""Waiting for an event with a deadline, the one way meshnet does it (ADR-0066).

The loops of the services that sleep until they are woken or their interval ends (the node agent's
heartbeats, the tracker's control loop, the relay tunnel's attach) wait here; the console, which reaches
meshnet only through its client, writes the same wait itself. ``asyncio.timeout``, not
``asyncio.wait_for``: on Python 3.11 ``wait_for`` returns the event's result when the event is set
in the same step as a cancel of the waiting task, and the cancel is lost (the loop outlives its
owner's shutdown). Torch-free and service-free.
"""

from __future__ import annotations

import asyncio

__all__ = ["wait_event"]


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` seconds pass; True when it was set. A cancel of
    the waiting task always propagates (:class:`asyncio.CancelledError`)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
