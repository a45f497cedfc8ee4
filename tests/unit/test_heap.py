"""The tracker's heap freezer (ADR-0059): the live heap goes to the collector's permanent
generation every FREEZE_EVERY_S and back every THAW_EVERY_S."""

from __future__ import annotations

import gc

from meshnet.tracker.heap import HeapFreezer


def test_the_heap_is_frozen_when_due_and_thawed_when_due():
    gc.unfreeze()
    freezer = HeapFreezer(freeze_every_s=5.0, thaw_every_s=60.0)
    start = freezer.frozen_s
    try:
        assert freezer.tick(start + 4.9) is None and gc.get_freeze_count() == 0
        kept = [[k] for k in range(1000)]  # tracked objects alive at the freeze
        assert freezer.tick(start + 5.0) == "freeze"
        assert gc.get_freeze_count() >= len(kept)
        assert freezer.tick(start + 9.9) is None  # the next freeze is 5 s after this one
        assert freezer.tick(start + 10.0) == "freeze"
        assert freezer.tick(start + 60.0) == "thaw" and gc.get_freeze_count() == 0
        assert freezer.tick(start + 64.9) is None  # a thaw starts the freeze interval again
        assert freezer.tick(start + 65.0) == "freeze"
    finally:
        gc.unfreeze()


def test_what_a_bulk_read_makes_joins_the_permanent_generation_without_a_collection_meanwhile():
    from meshnet.tracker.heap import frozen_after

    gc.unfreeze()
    collections = []
    record = lambda phase, info: collections.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.callbacks.append(record)
    try:
        with frozen_after():
            assert not gc.isenabled()
            records = [{"node": k, "shards": [k]} for k in range(20_000)]  # far past the young threshold
        assert gc.isenabled() and collections == [] and gc.get_freeze_count() >= len(records)
        gc.disable()
        with frozen_after():
            pass
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.callbacks.remove(record)
        gc.enable()
        gc.unfreeze()
