"""Group commit: store calls that arrive together share one transaction (ADR-0063).

A tracker's node calls reach the store one by one (a registration binds its key, writes its record
and reads its pins; a probe writes the record again). On PostgreSQL each was its own transaction
and round trips on the store's one connection, serialised behind its lock, so 10,000 nodes
registering at once queued 40,000 commits. :class:`GroupCommit` collects the items submitted from
the event loop while the previous batch is in the store and runs them as the next batch, on a
worker thread, with one call of a batch function (which writes them in one transaction): the
first call of a quiet tracker goes at once, and under load a batch is as big as what arrived
during the previous one. This is the write-ahead logs' group commit, applied to a tracker's calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")

#: the most items one batch carries (a batch's statements hold the store's lock, which the
#: event loop's own store calls wait for at most ``store.LOCK_WAIT_S``)
MAX_BATCH = 256


class GroupCommit(Generic[Item, Result]):
    """Runs ``run_batch(items) -> results`` (one result per item, in order) on a worker thread for
    every item submitted while the previous batch ran, one batch at a time.

    ``whole_batch_errors``: exceptions that fail every item of the batch as they are (the database
    is unreachable: each item alone would fail the same way, only later). Any other exception of a
    batch of several items runs each item alone, so one bad item fails only its own caller.
    Use from one event loop.
    """

    def __init__(self, run_batch: Callable[[list[Item]], Sequence[Result]],
                 whole_batch_errors: tuple[type[BaseException], ...] = (), max_batch: int = MAX_BATCH) -> None:
        self.run_batch = run_batch
        self.whole_batch_errors = whole_batch_errors
        self.max_batch = max_batch
        self._pending: list[tuple[Item, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        #: how many batches ran, and how many items they carried (for benches and tests)
        self.batches = 0
        self.items = 0

    async def submit(self, item: Item) -> Result:
        """``item``'s result, once the batch it joined is in the store.

        Raises:
            whatever ``run_batch`` raised for it (see the class).
        """
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            batch = [(item, f) for item, f in batch if not f.cancelled()]
            if not batch:
                continue
            self.batches += 1
            self.items += len(batch)
            try:
                outcomes = await asyncio.to_thread(self._run, [item for item, _ in batch])
            except asyncio.CancelledError:  # with the loop: so are its callers
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as exc:  # a broken batch function: every caller of the batch hears of it
                outcomes = [(False, exc)] * len(batch)
            for (_, future), (ok, value) in zip(batch, outcomes):
                if future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

    def _run(self, items: list[Item]) -> list[tuple[bool, object]]:
        """Each item's ``(True, result)`` or ``(False, exception)`` (on the worker thread)."""
        try:
            results = self.run_batch(items)
        except self.whole_batch_errors as exc:
            return [(False, exc)] * len(items)
        except Exception as exc:
            if len(items) == 1:
                return [(False, exc)]
            log.info("a batch of %d store calls failed (%s); running each alone", len(items), exc)
            return [one for item in items for one in self._run([item])]
        if len(results) != len(items):
            raise RuntimeError(f"a batch of {len(items)} items gave {len(results)} results")
        return [(True, r) for r in results]
