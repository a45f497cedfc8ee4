"""Group commit of a tracker's store calls (ADR-0063, meshnet.tracker.groupcommit)."""

from __future__ import annotations

import asyncio
import sqlite3

from meshnet.tracker.groupcommit import GroupCommit


def test_calls_that_arrive_together_share_a_batch_and_each_gets_its_own_result():
    seen: list[list[int]] = []

    def double(items: list[int]) -> list[int]:
        seen.append(list(items))
        return [2 * k for k in items]

    async def main() -> list[int]:
        commits = GroupCommit(double, max_batch=4)
        first = asyncio.create_task(commits.submit(0))
        await asyncio.sleep(0)  # the first goes alone, at once
        rest = [asyncio.create_task(commits.submit(k)) for k in range(1, 7)]
        return await asyncio.gather(first, *rest)

    assert asyncio.run(main()) == [0, 2, 4, 6, 8, 10, 12]
    assert seen == [[0], [1, 2, 3, 4], [5, 6]]


def test_one_bad_item_fails_only_its_own_caller():
    def parse(items: list[str]) -> list[int]:
        return [int(s) for s in items]

    async def main():
        commits = GroupCommit(parse)
        return await asyncio.gather(*(commits.submit(s) for s in ["1", "x", "3"]), return_exceptions=True)

    one, bad, three = asyncio.run(main())
    assert (one, three) == (1, 3)
    assert isinstance(bad, ValueError) and "'x'" in str(bad)


def test_a_database_error_fails_the_whole_batch_at_once():
    calls: list[list[str]] = []

    def unreachable(items: list[str]) -> list[str]:
        calls.append(items)
        raise sqlite3.OperationalError("database is locked")

    async def main():
        commits = GroupCommit(unreachable, whole_batch_errors=(sqlite3.OperationalError,))
        return await asyncio.gather(*(commits.submit(s) for s in "abc"), return_exceptions=True)

    results = asyncio.run(main())
    assert [type(r) for r in results] == [sqlite3.OperationalError] * 3
    assert calls == [["a", "b", "c"]]  # tried once, not once per item


def test_a_batch_function_that_loses_results_is_an_error():
    async def main():
        commits = GroupCommit(lambda items: items[:1])
        return await asyncio.gather(commits.submit(1), commits.submit(2), return_exceptions=True)

    results = asyncio.run(main())
    assert [str(r) for r in results] == ["a batch of 2 items gave 1 results"] * 2
