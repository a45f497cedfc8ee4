"""Every ending of a generation leaves no session on any hop (ADR-0031, ADR-0049): it finishes,
fails, fails over, or its client leaves; with one choice and with four; the error and the
departure both during prefill and during decode.

Real node apps under uvicorn (hop streams need sockets) with the tiny seeded model: the entry
holds layers [0, 2), ``b`` [2, 3), ``c`` and ``c2`` [3, 4) (the fixtures of test_hop_streams).
The choices run as the OpenAI surface runs them (:func:`choice_deltas`: one task per choice,
cancelled together when the consumer stops).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from meshnet.errors import HopFailed, MeshnetError
from meshnet.gateway.openai_api import choice_deltas
from meshnet.gateway.pipeline import GenerationStats
from meshnet.protocol.openai import SamplingParams, for_choice
from tests.service.test_hop_streams import PROMPT, nodes, orchestrator, routes_over  # noqa: F401 - fixture

NAMES = ["entry", "b", "c", "c2"]
#: the first decode step's position: the prompt is prefilled in chunks of 8 before it
DECODE_AT = len(PROMPT)


def held(nodes) -> dict[str, int]:
    """KV-cache sessions and hop chains held on each node."""
    return {n: len(nodes[n][1].runtime.sessions) + len(nodes[n][1].chains) for n in NAMES}


async def all_released(nodes, bound_s: float = 10.0) -> float:
    """Seconds until no node holds a session or a chain (polled; fails past ``bound_s``)."""
    t0 = time.monotonic()
    for _ in range(int(bound_s / 0.02)):
        if not any(held(nodes).values()):
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError(f"sessions left after {bound_s} s: {held(nodes)}")


async def consume(orch, n: int, max_tokens: int, stop_after: int | None = None) -> list[str]:
    """Run ``n`` choices; stop consuming (the client leaves) after ``stop_after`` pieces."""
    params = SamplingParams(max_tokens=max_tokens)
    stats = [GenerationStats() for _ in range(n)]
    pieces: list[str] = []
    gen = choice_deltas(orch, PROMPT, [for_choice(params, i) for i in range(n)], stats)
    try:
        async for _, piece, _ in gen:
            if piece is not None:
                pieces.append(piece)
                if stop_after is not None and len(pieces) >= stop_after:
                    break
    finally:
        await gen.aclose()
    return pieces


def fail_hop_at(node, position: int) -> None:
    """Make ``node``'s forward fail from ``position`` on (an error the hop reports)."""
    real = node.runtime.forward_async

    async def failing(**kw):
        if kw["position"] >= position:
            raise MeshnetError(f"injected failure at {kw['position']}", code="forward_failed", status=500)
        return await real(**kw)
    node.runtime.forward_async = failing


@pytest.mark.parametrize("n", [1, 4])
async def test_a_finished_generation_leaves_no_session(nodes, n):
    async with asyncio.timeout(60):
        pieces = await consume(orchestrator(nodes, routes_over(nodes, ["b", "c"])), n, 6)
        assert len(pieces) >= n
        print(f"n={n}: finished, every hop at 0 sessions after {await all_released(nodes):.3f} s")


@pytest.mark.parametrize("n", [1, 4])
async def test_a_client_that_leaves_during_decode_leaves_no_session(nodes, n):
    async with asyncio.timeout(60):
        assert len(await consume(orchestrator(nodes, routes_over(nodes, ["b", "c"])), n, 40, stop_after=1)) == 1
        print(f"n={n}: left during decode, every hop at 0 sessions after {await all_released(nodes):.3f} s")


@pytest.mark.parametrize("n", [1, 4])
async def test_a_client_that_leaves_during_prefill_leaves_no_session(nodes, n):
    """The client leaves while the entry's prefill chunks wait for the compute lock (a thread holds
    it): each choice's chunk is queued or about to run when its task is cancelled, and the entry's
    release must win over it, whichever reaches the lock first."""
    entry = nodes["entry"][1]
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]))
    gate, holding = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with entry.runtime.lock:
            holding.set()
            gate.wait(30)

    holder = threading.Thread(target=hold_lock, daemon=True)
    holder.start()
    async with asyncio.timeout(60):
        assert await asyncio.to_thread(holding.wait, 10)
        run = asyncio.create_task(consume(orch, n, 40))
        batcher = entry.runtime.batcher

        def waiting() -> int:  # first chunks queued, plus the one the batcher's runner took (blocked on the lock)
            return batcher.pending() + batcher._leading

        for _ in range(500):  # until every choice's first chunk waits in the entry's batcher
            if waiting() >= n:
                break
            await asyncio.sleep(0.01)
        assert waiting() == n
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        gate.set()
        await asyncio.to_thread(holder.join, 10)
        print(f"n={n}: left during prefill, every hop at 0 sessions after {await all_released(nodes):.3f} s")
        assert entry.runtime.tokens_processed <= 8  # the queued chunks were refused; the runner's may have run


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("phase, at", [("prefill", 8), ("decode", DECODE_AT + 2)])
async def test_an_error_leaves_no_session(nodes, n, phase, at):
    """The last hop fails (no other holder is routed): the generation fails with the hop's error
    and every hop, the failed one included, ends with no session."""
    fail_hop_at(nodes["c"][1], at)
    async with asyncio.timeout(60):
        with pytest.raises(HopFailed, match="injected failure"):
            await consume(orchestrator(nodes, routes_over(nodes, ["b", "c"])), n, 12)
        print(f"n={n}: failed during {phase}, every hop at 0 sessions after {await all_released(nodes):.3f} s")


@pytest.mark.parametrize("n", [1, 4])
async def test_a_failover_leaves_no_session_on_the_old_or_the_new_chain(nodes, tiny_hf_model, n):
    fail_hop_at(nodes["c"][1], DECODE_AT + 2)
    reported: list[str] = []
    async with asyncio.timeout(60):
        pieces = await consume(orchestrator(nodes, routes_over(nodes, ["b", "c"], ["b", "c2"]), reported), n, 8)
        assert pieces and set(reported) == {"c"}
        print(f"n={n}: failed over, every hop at 0 sessions after {await all_released(nodes):.3f} s")
