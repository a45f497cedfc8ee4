"""Batched decode beneath NodeRuntime.forward / run_entry: concurrent callers' decode steps run as
one forward, each caller gets exactly its session's rows, and session admission is unchanged
(tiny seeded llama, float32; every thread is joined within a bound)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.testing import assert_close

from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange
from meshnet.node.runtime import NodeRuntime
from meshnet.errors import SessionConflict

MODEL = "tiny-llama"
LENGTHS = {"s0": 3, "s1": 9, "s2": 1, "s3": 14, "s4": 6}
JOIN_S = 30.0


@pytest.fixture(scope="module")
def shard_path(tiny_model_path):
    return tiny_model_path(MODEL)


def runtime_of(path, layers: LayerRange, **kw) -> NodeRuntime:
    runtime = NodeRuntime(compute_dtype="float32", **kw)
    runtime.load(MODEL, path, layers)
    return runtime


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, 64, generator=torch.Generator().manual_seed(seed))


def concurrently(calls: dict[str, callable]) -> dict[str, object]:
    """Run every call in its own thread at once; their results (or exceptions) by name."""
    results: dict[str, object] = {}
    barrier = threading.Barrier(len(calls))

    def run(name, call):
        barrier.wait(JOIN_S)
        try:
            results[name] = call()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[name] = exc
    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
        assert not thread.is_alive()
    return results


def test_concurrent_decode_steps_of_ragged_sessions_batch_and_equal_solo(shard_path):
    layers = LayerRange(2, 4)
    batched, solo = runtime_of(shard_path, layers), runtime_of(shard_path, layers)
    sizes = []
    batched.on_batch = sizes.append
    for i, (sid, n) in enumerate(LENGTHS.items()):
        for rt in (batched, solo):
            rt.forward(model=MODEL, session_id=sid, layers=layers, position=0, hidden=prompt(n, i))
    sizes.clear()
    batched.batcher.window_s = JOIN_S  # from now on a leader waits until every active session is in
    batched.batcher.active_s = JOIN_S  # a loaded host may take over 1 s between steps
    for step in range(3):
        steps = {sid: prompt(1, 100 + 10 * step + i) for i, sid in enumerate(LENGTHS)}
        got = concurrently({sid: (lambda sid=sid: batched.forward(model=MODEL, session_id=sid, layers=layers,
                                                                   position=LENGTHS[sid] + step, hidden=steps[sid]))
                            for sid in LENGTHS})
        for sid in LENGTHS:
            want = solo.forward(model=MODEL, session_id=sid, layers=layers, position=LENGTHS[sid] + step,
                                hidden=steps[sid])
            assert got[sid].shape == (1, 1, 64)
            assert_close(got[sid], want, rtol=1e-5, atol=1e-5)
    assert sizes == [5, 5, 5]
    assert [size for _, size in list(batched.batch_sizes)[-3:]] == [5, 5, 5]
    assert batched.tokens_processed == sum(LENGTHS.values()) + 15
    assert all(batched.sessions._sessions[(sid, f"{MODEL}:2-4")].length == n + 3 for sid, n in LENGTHS.items())


def test_concurrent_entry_steps_batch_and_give_solo_greedy_tokens(shard_path):
    layers = LayerRange(0, 4)
    batched, solo = runtime_of(shard_path, layers), runtime_of(shard_path, layers)
    slot_b, slot_s = next(iter(batched.slots.values())), next(iter(solo.slots.values()))
    ids = {sid: torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(n)) for sid, n in LENGTHS.items()}
    tokens = {sid: [] for sid in LENGTHS}
    want = {sid: [] for sid in LENGTHS}
    for sid in LENGTHS:
        for rt, slot, out in ((batched, slot_b, tokens), (solo, slot_s, want)):
            hidden = rt.run_entry(slot, sid, ids[sid], 0, layers)
            out[sid].append(int(slot.shard.logits(hidden)[0, -1].argmax()))
    batched.batcher.window_s = JOIN_S
    batched.batcher.active_s = JOIN_S  # a loaded host may take over 1 s between steps
    for step in range(4):
        got = concurrently({sid: (lambda sid=sid: batched.run_entry(
            slot_b, sid, torch.tensor([[tokens[sid][-1]]]), LENGTHS[sid] + step, layers)) for sid in LENGTHS})
        for sid in LENGTHS:
            tokens[sid].append(int(slot_b.shard.logits(got[sid])[0, -1].argmax()))
            hidden = solo.run_entry(slot_s, sid, torch.tensor([[want[sid][-1]]]), LENGTHS[sid] + step, layers)
            want[sid].append(int(slot_s.shard.logits(hidden)[0, -1].argmax()))
    assert tokens == want
    assert max(size for _, size in batched.batch_sizes) == 5


def test_a_refused_step_fails_alone_and_the_rest_of_its_batch_runs(shard_path):
    layers = LayerRange(2, 4)
    rt = runtime_of(shard_path, layers)
    for sid in ("a", "b", "c"):
        rt.forward(model=MODEL, session_id=sid, layers=layers, position=0, hidden=prompt(4, 0))
    rt.batcher.window_s = JOIN_S
    rt.batcher.active_s = JOIN_S  # a loaded host may take over 1 s between steps
    got = concurrently({
        "a": lambda: rt.forward(model=MODEL, session_id="a", layers=layers, position=4, hidden=prompt(1, 1)),
        "b": lambda: rt.forward(model=MODEL, session_id="b", layers=layers, position=7, hidden=prompt(1, 2)),
        "c": lambda: rt.forward(model=MODEL, session_id="c", layers=layers, position=4, hidden=prompt(1, 3))})
    assert isinstance(got["b"], SessionConflict) and "holds 4 tokens, request is at position 7" in str(got["b"])
    assert got["a"].shape == got["c"].shape == (1, 1, 64)
    assert rt.batch_sizes[-1][1] == 2
    assert rt.sessions._sessions[("b", f"{MODEL}:2-4")].length == 4  # untouched


def test_two_calls_at_the_same_position_of_one_session_are_serialised_as_before(shard_path):
    layers = LayerRange(2, 4)
    rt = runtime_of(shard_path, layers, batch_window_s=0.0)
    rt.forward(model=MODEL, session_id="a", layers=layers, position=0, hidden=prompt(4, 0))
    got = concurrently({name: (lambda: rt.forward(model=MODEL, session_id="a", layers=layers, position=4,
                                                  hidden=prompt(1, 1))) for name in ("first", "second")})
    outcomes = sorted(type(v).__name__ for v in got.values())
    assert outcomes == ["SessionConflict", "Tensor"]
    assert rt.sessions._sessions[("a", f"{MODEL}:2-4")].length == 5


def test_an_unexpected_error_in_a_batch_drops_its_sessions_with_forward_failed(shard_path, monkeypatch):
    layers = LayerRange(2, 4)
    rt = runtime_of(shard_path, layers)
    for sid in ("a", "b"):
        rt.forward(model=MODEL, session_id=sid, layers=layers, position=0, hidden=prompt(4, 0))
    rt.batcher.window_s = JOIN_S
    rt.batcher.active_s = JOIN_S  # a loaded host may take over 1 s between steps
    shard = next(iter(rt.slots.values())).shard

    def broken(*args, **kwargs):
        raise RuntimeError("kernel fault")
    monkeypatch.setattr(shard, "forward_batch", broken)
    got = concurrently({sid: (lambda sid=sid: rt.forward(model=MODEL, session_id=sid, layers=layers, position=4,
                                                         hidden=prompt(1, 1))) for sid in ("a", "b")})
    for sid in ("a", "b"):
        assert isinstance(got[sid], MeshnetError) and got[sid].code == "forward_failed"
        assert "RuntimeError: kernel fault" in str(got[sid])
    assert len(rt.sessions) == 0
    with pytest.raises(SessionConflict, match="unknown session"):
        rt.forward(model=MODEL, session_id="a", layers=layers, position=5, hidden=prompt(1, 1))


def test_concurrent_lm_head_steps_batch_and_equal_solo_logits(shard_path, monkeypatch):
    layers = LayerRange(0, 4)
    rt = runtime_of(shard_path, layers)
    slot = next(iter(rt.slots.values()))
    hiddens = {f"g{i}": prompt(1, 50 + i) for i in range(4)}
    for name, hidden in hiddens.items():  # each generation once alone: now all four are active
        assert_close(rt.logits(slot, name, hidden), slot.shard.logits(hidden))
    rt.batcher.window_s = JOIN_S
    rt.batcher.active_s = JOIN_S  # a loaded host may take over 1 s between steps
    runs_before = len(rt.batch_sizes)
    shapes, head = [], slot.shard.logits
    monkeypatch.setattr(slot.shard, "logits", lambda hidden: shapes.append(tuple(hidden.shape)) or head(hidden))
    got = concurrently({name: (lambda name=name: rt.logits(slot, name, hiddens[name])) for name in hiddens})
    monkeypatch.undo()
    assert shapes == [(4, 1, 64)]  # one matmul for the four generations
    for name, hidden in hiddens.items():
        want = slot.shard.logits(hidden)
        assert got[name].shape == (1, 1, 512) and got[name].dtype == torch.float32
        assert_close(got[name], want, rtol=1e-5, atol=1e-5)
        assert int(got[name].argmax()) == int(want.argmax())
    assert len(rt.batch_sizes) == runs_before  # head runs are not forwards through layers
    assert len(rt.sessions) == 0


def test_the_lm_head_needs_an_entry_slot_and_scores_every_position_it_is_given(shard_path):
    rt = runtime_of(shard_path, LayerRange(2, 4))
    with pytest.raises(MeshnetError, match="holds no LM head"):
        rt.logits(next(iter(rt.slots.values())), "g", prompt(1, 0))
    entry = runtime_of(shard_path, LayerRange(0, 4))
    slot = next(iter(entry.slots.values()))
    with pytest.raises(MeshnetError, match=r"takes positions \[1, n, hidden\], got \[2, 3, 64\]"):
        entry.logits(slot, "g", torch.zeros(2, 3, 64))
    hidden = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
    rows = entry.logits(slot, "g", hidden)  # one row per position, as the head alone gives them
    assert rows.shape == (3, 1, slot.shard.config.vocab_size)
    assert torch.equal(rows[:, 0], slot.shard.logits(hidden)[0])


async def test_a_lone_decode_step_awaited_from_a_loop_runs_off_the_loop_and_equals_forward(shard_path):
    """An event loop never computes (ADR-0049): even a step with nothing to batch with runs in the
    batcher's runner thread, and gives what the blocking :meth:`forward` gives."""
    layers = LayerRange(2, 4)
    loop_side, blocking = runtime_of(shard_path, layers), runtime_of(shard_path, layers)
    ran_on: list[int] = []
    run = loop_side._run_locked
    loop_side._run_locked = lambda steps: (ran_on.append(threading.get_ident()), run(steps))[1]
    hidden = prompt(5, 7)
    blocking.forward(model=MODEL, session_id="s", layers=layers, position=0, hidden=hidden)
    await loop_side.forward_async(model=MODEL, session_id="s", layers=layers, position=0, hidden=hidden)
    step = prompt(1, 8)
    out = await loop_side.forward_async(model=MODEL, session_id="s", layers=layers, position=5, hidden=step)
    assert_close(out, blocking.forward(model=MODEL, session_id="s", layers=layers, position=5, hidden=step),
                 rtol=0, atol=0)
    assert len(ran_on) == 2 and threading.get_ident() not in ran_on
    assert [sess.length for sess in loop_side.sessions._sessions.values()] == [6]


async def test_a_released_session_is_not_waited_for_by_the_next_sessions_lm_head(shard_path):
    """The entry names its LM-head steps by the session, so releasing the session ends the wait for
    them: a generation that starts within ``active_s`` of another's end runs its head at once
    instead of waiting a batch window for the ended one at every token."""
    from meshnet.node.entry import LocalEntry
    from meshnet.protocol.openai import SamplingParams

    rt = runtime_of(shard_path, LayerRange(0, 4))
    slot = next(iter(rt.slots.values()))
    entry = LocalEntry(rt, slot, wire_dtype="float32")
    rt.batcher.active_s = rt.batcher.window_s = JOIN_S  # "ended" stays expected, however slow the host
    await entry.choose(prompt(1, 60), entry.new_chooser(SamplingParams(max_tokens=1)), "ended")
    assert rt.batcher._wait_share([rt._head_step(slot, "next", prompt(1, 61))]) is not None  # would wait
    entry.release("ended")
    assert rt.batcher._wait_share([rt._head_step(slot, "next", prompt(1, 61))]) is None
    t0 = time.monotonic()
    logits = await rt.logits_async(slot, "next", prompt(1, 61))
    assert time.monotonic() - t0 < JOIN_S / 2  # ran at once, not after the window
    assert_close(logits, slot.shard.logits(prompt(1, 61)))
