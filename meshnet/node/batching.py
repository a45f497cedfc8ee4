"""Batched decode on a node: steps of different sessions that meet within a short window run as
one forward (ADR-0052).

Callers are event loops (hop streams, the entry node's own layers and LM head, HTTP hop calls)
and threads. A loop hands its step to :meth:`StepBatcher.submit_soon` without blocking and awaits
the future it gets; a thread calls :meth:`StepBatcher.submit` and blocks until the step has run.
One caller at a time is the *leader*: it gathers the steps that can run together, has them run,
and hands every caller its result. For loops' steps the leader is the batcher's own runner
thread, and a batch's results reach each loop in one call (one thread hand-off per batch, not one
per step: ADR-0049); a blocked thread may lead too. While a batch runs,
new steps queue; the next leader takes them all at once, so a busy node batches without waiting
at all.

Policy (pure data in, list of steps out; :meth:`StepBatcher._collect`):

- The oldest pending step always runs in the next batch (first come, first served: no step waits
  behind younger ones forever).
- A decode step (one token, or a speculative step of a few: ADR-0058) batches with the other
  pending decode steps of its *group* (same shard slot, same layers, same kind of input), oldest
  first, one step per session, at most ``max_batch`` steps. A prefill chunk runs alone.
- A decode step that finds the node idle may wait for other sessions of its group that it
  *expects*: those whose last step of the group here ended within ``active_s`` but before this
  step arrived, that have no step queued, and that have not been forgotten
  (:meth:`StepBatcher.forget`).
- Sessions travel in *waves*: the sessions of one batch reach the next node together and come
  back together. A batch waits only for the expected sessions of its own waves (the batches its
  sessions were in last time here), at most the window after its oldest step arrived
  (``window_s``, or :data:`WINDOW_COMPUTE_SHARE` of the group's recent decode-batch compute time
  when longer). A first decode step, whose session has no wave yet, waits for every expected
  session, prefilled ones included, so sessions that start together decode together.
- Waves merge: a batch also waits, up to :data:`MERGE_COMPUTE_SHARE` of a batch's compute time,
  for a session of another wave that is *due* within that time (its previous step here plus its
  last round trip). Of two waves, only the one ahead waits; the one behind sees the other due a
  whole round trip later and goes on, so the gap closes within a stage or two and the node runs
  one batch where it ran several. Waiting for a wave that is not due would only idle the node.
- It stops waiting as soon as all it waits for are in, or ``max_batch`` is reached. With one
  session active nobody waits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

from meshnet.stats import EMA

#: a leader may wait up to this share of its group's recent decode-batch compute time, when that is
#: longer than ``window_s``: a step that joins saves a batch of its own, which costs about as much
WINDOW_COMPUTE_SHARE = 0.5
#: the batcher's runner thread ends after this many seconds without a loop's step to lead (a new
#: step starts it again): an idle node, or a test's runtime, keeps no thread
RUNNER_IDLE_S = 30.0
#: a batch waits up to this share of a batch's compute time for a wave due right behind it: a wave
#: that trails another queues behind its compute, about one batch time behind, so a shorter wait
#: never closes the gap (measured with ``bench/batching.py``, ADR-0052)
MERGE_COMPUTE_SHARE = 1.5


@dataclass(eq=False)
class Step:
    """One caller's unit of work: ``tokens`` positions of session ``session_id``.

    Attributes:
        group: steps batch only with steps of the same group.
        tokens: 1 for a decode step, more for a speculative step or a prefill chunk (alone unless ``decode``).
        work: what the runner needs to run it (opaque to the batcher).
        arrived_s: monotonic seconds when it was submitted.
    """

    session_id: str
    group: Hashable
    tokens: int
    work: object
    #: it batches with the group's other decode steps: a one-token step, or a speculative step of a
    #: few positions (ADR-0058; None: one token)
    decode: bool | None = None
    arrived_s: float = field(default_factory=time.monotonic)
    result: object = None
    error: BaseException | None = None
    done: bool = False
    #: where an event loop awaits the step (:meth:`StepBatcher.submit_soon`); None for a blocked thread
    waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def __post_init__(self) -> None:
        if self.decode is None:
            self.decode = self.tokens == 1

    def finish(self, result: object) -> None:
        self.result, self.done = result, True

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


@dataclass
class _Seen:
    """What a batcher knows of one session in one group: when its last step here ended (or arrived,
    while queued), the decode batch it was in last (its wave; None before its first), when its
    latest decode step arrived, and the time since the one before (its round trip; None before
    its second)."""

    last_s: float
    wave: int | None = None
    arrived_s: float | None = None
    round_s: float | None = None


class StepBatcher:
    """Gathers concurrent callers' steps into batches and runs each batch with ``run``.

    Args:
        run: ``run(steps)`` runs one batch: it calls ``finish`` or ``fail`` on every step (a step
            it leaves unfinished fails with a RuntimeError; an exception it raises fails every
            unfinished step of the batch).
        window_s: longest wait for more sessions after a decode step reaches an idle node, seconds
            (>= 0).
        max_batch: most steps in one batch (>= 1).
        active_s: a session that sent no step of a group for this long is no longer waited for,
            seconds (> 0).
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: a setting out of range.
    """

    def __init__(self, run: Callable[[list[Step]], None], *, window_s: float = 0.005, max_batch: int = 16,
                 active_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s < 0 or max_batch < 1 or active_s <= 0:
            raise ValueError(f"batching needs window_s >= 0, max_batch >= 1 and active_s > 0, got {window_s}, "
                             f"{max_batch} and {active_s}")
        self.run, self.window_s, self.max_batch, self.active_s, self.clock = run, window_s, max_batch, active_s, clock
        self._cond = threading.Condition()
        self._pending: list[Step] = []
        self._seen: dict[Hashable, dict[str, _Seen]] = {}  # group -> session id -> what is known of it
        self._leading = False
        self._compute_s: dict[Hashable, EMA] = {}  # group -> seconds a decode batch of it takes to run
        self._batches = 0  # decode batches run, numbering the waves
        self._runner: threading.Thread | None = None  # leads the batches of loops' steps (submit_soon)

    def submit(self, step: Step) -> object:
        """Queue ``step``, wait until it has run (leading a batch when no one else does) and
        return its result.

        Raises:
            whatever the runner failed the step with.
        """
        with self._cond:
            self._queue(step)
            while not step.done:
                if self._leading:
                    self._cond.wait()
                    continue
                self._lead()
        if step.error is not None:
            raise step.error
        return step.result

    def submit_soon(self, step: Step) -> asyncio.Future:
        """Queue ``step`` from the running event loop without blocking it; the future returned gets
        the step's result (or its error) once it has run. The batcher's runner thread leads the
        batch (started here when it is not running), and hands each loop the results of a batch
        in one ``call_soon_threadsafe``. Cancelling the future does not unqueue the step.

        Raises:
            RuntimeError: no event loop runs in this thread.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        step.waiter = (loop, future)
        with self._cond:
            self._queue(step)
            if self._runner is None:
                self._runner = threading.Thread(target=self._run_loop_steps, name="meshnet-batcher", daemon=True)
                self._runner.start()
        return future

    def _queue(self, step: Step) -> None:
        """Add ``step`` to the queue and wake whoever leads or may lead (holding the condition)."""
        step.arrived_s = self.clock()
        self._pending.append(step)
        self._arrived(step)
        self._cond.notify_all()

    def _run_loop_steps(self) -> None:
        """The runner thread: lead a batch whenever a loop's step is queued and nobody leads; end
        after :data:`RUNNER_IDLE_S` without one."""
        with self._cond:
            try:
                while True:
                    if self._leading or not any(step.waiter for step in self._pending):
                        if not self._cond.wait(RUNNER_IDLE_S) and not any(step.waiter for step in self._pending):
                            return
                        continue
                    self._lead()
            finally:
                self._runner = None

    def _lead(self) -> None:
        """Collect a batch, run it with the condition released, then hand out its results: blocked
        threads are woken, each loop gets its steps' results in one call (holding the condition)."""
        self._leading = True
        try:
            batch = self._collect()
            self._cond.release()
            started_s = self.clock()
            try:
                self._execute(batch, self.run)
            finally:
                self._cond.acquire()
                self._ran(batch, started_s)
                _wake(batch)
        finally:
            self._leading = False
            self._cond.notify_all()

    def _ran(self, batch: list[Step], started_s: float) -> None:
        """Bookkeeping after a batch ran (holding the condition): its sessions' last step here, and
        for a decode batch their wave and the group's decode-batch compute time."""
        finished_s = self.clock()
        group, decode = batch[0].group, batch[0].decode
        seen = self._seen.setdefault(group, {})
        if decode:
            self._batches += 1
        for done in batch:
            session = seen.setdefault(done.session_id, _Seen(finished_s))
            session.last_s = finished_s
            if decode:
                session.wave = self._batches
        if decode:
            self._compute_s.setdefault(group, EMA(0.2)).update(finished_s - started_s)

    def forget(self, session_id: str) -> None:
        """``session_id`` ended here: batches no longer wait for its steps."""
        with self._cond:
            for sessions in self._seen.values():
                sessions.pop(session_id, None)

    def window(self, group: Hashable, share: float = WINDOW_COMPUTE_SHARE) -> float:
        """Longest wait, seconds, for expected sessions of ``group``: ``window_s``, or ``share`` of
        the group's recent decode-batch compute time when longer (a slow or loaded host, where a
        round's steps arrive further apart)."""
        compute = self._compute_s.get(group)
        return max(self.window_s, share * compute.value) if compute else self.window_s

    def pending(self) -> int:
        """Steps queued and not yet taken into a batch."""
        with self._cond:
            return len(self._pending)

    def _collect(self) -> list[Step]:
        """The next batch, taken out of the queue (called by the leader, holding the condition)."""
        while True:
            head = self._pending[0]
            batch = [head]
            if head.decode:
                batch = self._decode_batch(head)
                if len(batch) >= self.max_batch:
                    break
                share = self._wait_share(batch)
                if share is None:
                    break
                remaining = head.arrived_s + self.window(head.group, share) - self.clock()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
                continue
            break
        for step in batch:
            self._pending.remove(step)
        return batch

    def _decode_batch(self, head: Step) -> list[Step]:
        batch, sessions = [], set()
        for step in self._pending:
            if step.group == head.group and step.decode and step.session_id not in sessions:
                batch.append(step)
                sessions.add(step.session_id)
                if len(batch) == self.max_batch:
                    break
        return batch

    def _arrived(self, step: Step) -> None:
        """Note a step's arrival as its session's last step here and, for a decode step, the time
        since the session's previous one here (its round trip through the route), for
        :meth:`_wait_share` (holding the condition)."""
        session = self._seen.setdefault(step.group, {}).setdefault(step.session_id, _Seen(step.arrived_s))
        session.last_s = step.arrived_s
        if step.decode:
            if session.arrived_s is not None:
                session.round_s = step.arrived_s - session.arrived_s
            session.arrived_s = step.arrived_s

    def _wait_share(self, batch: list[Step]) -> float | None:
        """How long ``batch`` (its oldest step first) may still wait for sessions that could join
        it, as a share of the group's decode-batch compute time (:meth:`window`); None when it
        waits for nobody.

        A session can join when it is active in the group, has no step queued, and its last step
        here was over before the batch's oldest step arrived (a session served while the batch
        waited cannot be back before its next trip round the route, far longer than the window).
        The batch waits, up to :data:`WINDOW_COMPUTE_SHARE`, for such a session of its own waves,
        for any such session when one of its own has no wave yet (its first decode step), and for
        one of another wave whose round trip is not known yet (one decode step here so far); and,
        up to :data:`MERGE_COMPUTE_SHARE`, for one of another wave that is due within that much:
        its previous step here plus its last round trip. The wave due a round trip later is not
        waited for: it is the one that left just now.
        """
        head = batch[0]
        now = self.clock()
        seen = self._seen.get(head.group, {})
        for session_id in [s for s, session in seen.items() if now - session.last_s > self.active_s]:
            del seen[session_id]
        mine = {seen[step.session_id].wave if step.session_id in seen else None for step in batch}
        first = None in mine  # a first decode step waits for everyone
        queued = {step.session_id for step in self._pending}
        merge_by = head.arrived_s + self.window(head.group, MERGE_COMPUTE_SHARE)
        share = None
        for session_id, session in seen.items():
            if session_id in queued or session.last_s > head.arrived_s:
                continue
            if first or session.wave in mine or (session.wave is not None and session.round_s is None):
                share = WINDOW_COMPUTE_SHARE
            elif session.wave is not None and session.arrived_s + session.round_s <= merge_by:
                return MERGE_COMPUTE_SHARE
        return share

    def _execute(self, batch: list[Step], run: Callable[[list[Step]], None]) -> None:
        try:
            run(batch)
        except BaseException as exc:
            for step in batch:
                if not step.done:
                    step.fail(exc)
            if not isinstance(exc, Exception):
                raise
        for step in batch:
            if not step.done:
                step.fail(RuntimeError(f"the batch runner left the step of session {step.session_id} unfinished"))


def _wake(batch: list[Step]) -> None:
    """Hand the loops awaiting steps of ``batch`` their results: one ``call_soon_threadsafe`` per
    loop (a closed loop's steps are dropped: nobody awaits them any more)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Step]] = {}
    for step in batch:
        if step.waiter is not None:
            by_loop.setdefault(step.waiter[0], []).append(step)
    for loop, steps in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, steps)
        except RuntimeError:  # the loop closed
            pass


def _settle(steps: list[Step]) -> None:
    """Set each step's future (on its loop) from its outcome, unless the awaiting side gave up."""
    for step in steps:
        future = step.waiter[1]
        if future.cancelled():
            continue
        if step.error is not None:
            future.set_exception(step.error)
        else:
            future.set_result(step.result)
