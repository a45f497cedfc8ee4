"""The step batcher (meshnet.node.batching): who batches with whom, how long a leader waits, and
that every caller gets its own result. A fake runner records the batches; every wait is bounded."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from meshnet.node import batching
from meshnet.node.batching import Step, StepBatcher

WAIT_S = 10.0  # bound on every join and poll in these tests


class Recorder:
    """A runner that records each batch as (session, work) pairs and answers ``work * 10``.

    A step whose work is ``"gate"`` blocks its batch until :attr:`open` is set, so a test can
    queue steps behind it and know exactly what the next leader finds.
    """

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, object]]] = []
        self.open = threading.Event()

    def __call__(self, steps: list[Step]) -> None:
        self.batches.append([(s.session_id, s.work) for s in steps])
        for step in steps:
            if step.work == "gate":
                assert self.open.wait(WAIT_S)
                step.finish("gate")
            else:
                step.finish(step.work * 10)


def decode(session: str, work: int = 1, group: str = "g") -> Step:
    return Step(session, group, 1, work)


def start(batcher: StepBatcher, step: Step, results: dict) -> threading.Thread:
    def run():
        try:
            results[step.session_id, step.work] = batcher.submit(step)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[step.session_id, step.work] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_pending(batcher: StepBatcher, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while batcher.pending() < n:
        assert time.monotonic() < deadline, f"only {batcher.pending()} of {n} steps queued"
        time.sleep(0.001)


def run_behind_gate(batcher: StepBatcher, recorder: Recorder, steps: list[Step]) -> dict:
    """Run a gate step, queue ``steps`` (in order) while it runs, open it, and collect every result."""
    results: dict = {}
    recorder.open.clear()
    ran = len(recorder.batches)
    threads = [start(batcher, Step("gatekeeper", "gate-group", 5, "gate"), results)]
    deadline = time.monotonic() + WAIT_S
    while len(recorder.batches) == ran:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for i, step in enumerate(steps):
        threads.append(start(batcher, step, results))
        wait_pending(batcher, i + 1)
    recorder.open.set()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    return results


def test_one_session_runs_at_once_whatever_the_window():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=30.0)
    t0 = time.monotonic()
    assert [batcher.submit(decode("a", i)) for i in range(3)] == [0, 10, 20]
    assert time.monotonic() - t0 < 5.0  # never the 30 s window: nobody else is active
    assert recorder.batches == [[("a", 0)], [("a", 1)], [("a", 2)]]


def test_steps_queued_while_a_batch_runs_go_together_and_each_caller_gets_its_row():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.0)
    results = run_behind_gate(batcher, recorder, [decode(s, w) for s, w in (("a", 1), ("b", 2), ("c", 3))])
    assert recorder.batches[1:] == [[("a", 1), ("b", 2), ("c", 3)]]
    assert results == {("gatekeeper", "gate"): "gate", ("a", 1): 10, ("b", 2): 20, ("c", 3): 30}


def test_batches_hold_at_most_max_batch_steps_oldest_first():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.0, max_batch=2)
    run_behind_gate(batcher, recorder, [decode(s) for s in "abcde"])
    assert [[s for s, _ in batch] for batch in recorder.batches[1:]] == [["a", "b"], ["c", "d"], ["e"]]


def test_a_session_has_one_step_per_batch():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.0)
    results = run_behind_gate(batcher, recorder, [decode("a", 1), decode("a", 2), decode("b", 3)])
    assert recorder.batches[1:] == [[("a", 1), ("b", 3)], [("a", 2)]]
    assert results[("a", 2)] == 20


def test_a_prefill_chunk_runs_alone_and_the_queue_stays_first_come_first_served():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.0)
    run_behind_gate(batcher, recorder, [decode("a", 1), Step("p", "g", 128, 7), decode("b", 2), decode("c", 3)])
    assert recorder.batches[1:] == [[("a", 1), ("b", 2), ("c", 3)], [("p", 7)]]
    recorder2 = Recorder()
    batcher2 = StepBatcher(recorder2, window_s=0.0)
    run_behind_gate(batcher2, recorder2, [Step("p", "g", 128, 7), decode("a", 1), decode("b", 2)])
    assert recorder2.batches[1:] == [[("p", 7)], [("a", 1), ("b", 2)]]


def test_steps_of_different_groups_do_not_batch():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.0)
    run_behind_gate(batcher, recorder, [decode("a", 1, "x"), decode("b", 2, "y"), decode("c", 3, "x")])
    assert recorder.batches[1:] == [[("a", 1), ("c", 3)], [("b", 2)]]


def test_an_idle_node_waits_within_the_window_for_an_active_session():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=WAIT_S)
    assert batcher.submit(decode("b", 0)) == 0  # b is active now
    results: dict = {}
    t0 = time.monotonic()
    leader = start(batcher, decode("a", 1), results)
    time.sleep(0.2)
    assert recorder.batches == [[("b", 0)]]  # a waits for b
    follower = start(batcher, decode("b", 2), results)
    for thread in (leader, follower):
        thread.join(WAIT_S)
    assert recorder.batches[1:] == [[("a", 1), ("b", 2)]]
    assert results == {("a", 1): 10, ("b", 2): 20}
    assert 0.2 <= time.monotonic() - t0 < WAIT_S


def test_the_wait_ends_with_the_window_when_the_active_session_does_not_come():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.3)
    batcher.submit(decode("b", 0))
    t0 = time.monotonic()
    assert batcher.submit(decode("a", 1)) == 10
    assert 0.3 <= time.monotonic() - t0 < 3.0


def test_a_forgotten_or_long_idle_session_is_not_waited_for():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=30.0)
    batcher.submit(decode("b", 0))
    batcher.forget("b")
    t0 = time.monotonic()
    batcher.submit(decode("a", 1))
    assert time.monotonic() - t0 < 5.0
    now = [100.0]
    idle = StepBatcher(Recorder(), window_s=30.0, active_s=1.0, clock=lambda: now[0])
    idle.submit(decode("b", 0))
    now[0] = 101.5  # b last stepped 1.5 s ago
    t0 = time.monotonic()
    idle.submit(decode("a", 1))
    assert time.monotonic() - t0 < 5.0


def test_a_failing_runner_fails_every_step_of_its_batch_and_the_batcher_goes_on():
    calls = []

    def runner(steps):
        calls.append([s.session_id for s in steps])
        if len(calls) == 1:
            raise ValueError("boom")
        steps[0].finish("ok")  # and leaves the others unfinished

    batcher = StepBatcher(runner, window_s=0.0)
    with pytest.raises(ValueError, match="boom"):
        batcher.submit(decode("a"))
    assert batcher.submit(decode("a", 2)) == "ok"


def test_a_step_the_runner_leaves_unfinished_fails_clearly():
    batcher = StepBatcher(lambda steps: None, window_s=0.0)
    with pytest.raises(RuntimeError, match="left the step of session a unfinished"):
        batcher.submit(decode("a"))


@pytest.mark.parametrize("kw", [{"window_s": -1}, {"max_batch": 0}, {"active_s": 0}])
def test_settings_out_of_range_raise(kw):
    with pytest.raises(ValueError, match="batching needs"):
        StepBatcher(Recorder(), **kw)


def test_many_concurrent_sessions_all_get_their_own_result():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.002, max_batch=8)
    results: dict = {}
    threads = [start(batcher, decode(f"s{i}", i), results) for i in range(40)]
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert results == {(f"s{i}", i): i * 10 for i in range(40)}
    assert sorted(w for batch in recorder.batches for _, w in batch) == list(range(40))
    assert max(len(batch) for batch in recorder.batches) <= 8


def test_the_window_stretches_to_half_the_groups_recent_decode_compute():
    now = [0.0]

    def slow(steps):  # each batch takes 2 s of the fake clock
        now[0] += 2.0
        for step in steps:
            step.finish(step.work)

    batcher = StepBatcher(slow, window_s=0.005, clock=lambda: now[0])
    assert batcher.window("g") == 0.005  # nothing run yet: the setting
    batcher.submit(decode("a", 1))
    assert batcher.window("g") == pytest.approx(1.0)  # half of 2 s
    assert batcher.window("other") == 0.005
    batcher.submit(Step("p", "g", 64, 2))  # a prefill chunk does not count
    assert batcher.window("g") == pytest.approx(1.0)


def test_the_wave_ahead_waits_for_the_wave_due_behind_it_and_they_merge():
    shift = [0.0]  # the clock runs with real time, and jumps where the test moves it
    batches: list[list[str]] = []

    def runner(steps):  # each batch takes 1 s of the clock
        batches.append([step.session_id for step in steps])
        shift[0] += 1.0
        for step in steps:
            step.finish(step.work)

    batcher = StepBatcher(runner, window_s=0.0, active_s=60.0, clock=lambda: time.monotonic() + shift[0])
    assert batcher.submit(decode("a", 1)) == 1
    assert batcher.submit(decode("b", 2)) == 2  # a first step: waits half a batch time for a, in vain
    shift[0] += 8.0  # a's round trip: about 10 s
    assert batcher.submit(decode("a", 3)) == 3  # b's round trip is not known: a waits half a batch time
    t0 = time.monotonic()
    assert batcher.submit(decode("b", 4)) == 4  # a is due about 10 s after it came: b goes on at once
    assert time.monotonic() - t0 < 1.0
    assert batches == [["a"], ["b"], ["a"], ["b"]]
    shift[0] += 9.0  # a comes again; b, a round trip after its last step, is due 1 s behind it
    results: dict = {}
    leader = start(batcher, decode("a", 5), results)
    wait_pending(batcher, 1)
    time.sleep(0.2)
    assert batches[4:] == []  # a waits for b
    shift[0] += 1.0  # b arrives a second later, within 1.5 batch times
    follower = start(batcher, decode("b", 6), results)
    for thread in (leader, follower):
        thread.join(WAIT_S)
    assert batches[4:] == [["a", "b"]]
    assert results == {("a", 5): 5, ("b", 6): 6}


def test_a_session_still_in_prefill_is_waited_for_by_a_first_decode_step_only():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.3)
    assert batcher.submit(decode("a", 1)) == 10  # a decodes here: the anchor
    batcher.window_s = 30.0
    batcher.submit(Step("b", "g", 64, 0))  # b's prompt, in one chunk
    t0 = time.monotonic()
    assert batcher.submit(decode("a", 2)) == 20
    assert time.monotonic() - t0 < 5.0  # not the 30 s window: b has not decoded here yet
    batcher.window_s = 0.3
    batcher.submit(Step("c", "g", 64, 0))
    t0 = time.monotonic()
    assert batcher.submit(decode("c", 3)) == 30  # c's first decode step waits for a and b
    assert 0.3 <= time.monotonic() - t0 < 3.0


def test_steps_queued_from_a_loop_run_as_one_batch_and_come_back_in_one_call():
    recorder = Recorder()
    batcher = StepBatcher(recorder, window_s=0.0)
    results: dict = {}
    gate = threading.Thread(target=lambda: results.update(gate=batcher.submit(Step("gatekeeper", "gg", 5, "gate"))),
                            daemon=True)
    gate.start()
    deadline = time.monotonic() + WAIT_S
    while not recorder.batches:
        assert time.monotonic() < deadline
        time.sleep(0.001)

    async def main() -> list:
        loop = asyncio.get_running_loop()
        calls = []
        threadsafe = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **kw: (calls.append(a[0].__name__), threadsafe(*a, **kw))[1]
        futures = [batcher.submit_soon(decode(f"s{i}", i)) for i in range(1, 6)]
        assert batcher.pending() == 5  # queued without blocking the loop, behind the gate
        recorder.open.set()
        async with asyncio.timeout(WAIT_S):
            outs = await asyncio.gather(*futures)
        return outs, calls

    outs, calls = asyncio.run(main())
    gate.join(WAIT_S)
    assert outs == [10, 20, 30, 40, 50] and results == {"gate": "gate"}
    assert recorder.batches[1] == [(f"s{i}", i) for i in range(1, 6)]  # one batch, run by the runner thread
    assert calls == ["_settle"]  # the loop was handed the five results once


def test_a_loop_step_gets_its_error_and_the_runner_thread_ends_when_idle(monkeypatch):
    monkeypatch.setattr(batching, "RUNNER_IDLE_S", 0.05)

    def runner(steps):
        for step in steps:
            step.fail(ValueError(f"bad {step.session_id}")) if step.work == 0 else step.finish(step.work)

    batcher = StepBatcher(runner)

    async def main():
        async with asyncio.timeout(WAIT_S):
            ok = await batcher.submit_soon(decode("a", 7))
            with pytest.raises(ValueError, match="bad b"):
                await batcher.submit_soon(decode("b", 0))
        return ok

    assert asyncio.run(main()) == 7
    deadline = time.monotonic() + WAIT_S
    while batcher._runner is not None:  # no step for RUNNER_IDLE_S: the thread ends
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert asyncio.run(main()) == 7  # and a new step starts it again
