"""The longest time an asyncio event loop went without running a ready task (ADR-0037).

A probe task sleeps :data:`TICK_S` in a loop and records how much later than asked it wakes: while
the loop runs a callback that does not yield, the probe waits, so its worst lateness is the
longest block any request on that loop could have met. Used by ``bench/placement.py`` (during a
rebalance) and ``bench/heartbeats.py`` (while the nodes heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

#: the probe's sleep, seconds (1 ms: short against the 50 ms target, long against a wake-up's cost)
TICK_S = 0.001


class LoopLag:
    """``async with LoopLag() as lag: ...``; afterwards ``lag.worst_s`` is the longest block, seconds."""

    def __init__(self) -> None:
        self.worst_s = 0.0
        self._task: asyncio.Task | None = None

    async def _probe(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(TICK_S)
            self.worst_s = max(self.worst_s, time.perf_counter() - t0 - TICK_S)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._probe())
        await asyncio.sleep(0.01)  # the probe is running before the block measured starts
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def log_as_served() -> None:
    """Log as ``meshnet serve`` does by default (INFO, :func:`meshnet.cli.output.setup_logging`), into
    /dev/null: what formatting and writing the tracker's log lines costs the loop is in the figures
    (a bench without a handler skips it, and once hid 7,000 INFO lines a cold rebalance wrote)."""
    import logging
    import os

    from meshnet.cli.output import setup_logging
    setup_logging("INFO")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(open(os.devnull, "w"))  # noqa: SIM115 - for the life of the bench
