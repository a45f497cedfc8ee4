"""KV-cache sessions (meshnet.node.runtime): start, continuation, TTL expiry, admission under the cap, release."""

from __future__ import annotations

import pytest
import torch

from meshnet.errors import SessionConflict
from meshnet.node.sessions import SessionCacheFull, SessionStore


def fill(session, n_bytes: int) -> None:
    """Put ``n_bytes`` of keys plus ``n_bytes`` of values into layer 0 of the session's cache."""
    tensor = torch.zeros(n_bytes // 4)
    session.cache.update(tensor, tensor.clone(), 0)


def test_position_zero_starts_a_session():
    store = SessionStore()
    session = store.acquire("s1", "slot", 0, now=0.0)
    assert session.length == 0 and len(store) == 1
    store.commit(session, 10)
    assert store.acquire("s1", "slot", 10, now=1.0) is session
    assert session.length == 10


def test_position_zero_restarts_an_existing_session():
    store = SessionStore()
    first = store.acquire("s1", "slot", 0, now=0.0)
    store.commit(first, 10)
    second = store.acquire("s1", "slot", 0, now=1.0)
    assert second is not first and second.length == 0 and len(store) == 1


def test_wrong_position_is_a_409_conflict():
    store = SessionStore()
    store.commit(store.acquire("s1", "slot", 0, now=0.0), 10)
    with pytest.raises(SessionConflict, match="session 's1' holds 10 tokens, request is at position 9") as info:
        store.acquire("s1", "slot", 9, now=1.0)
    assert info.value.status == 409 and info.value.code == "session_conflict"
    assert info.value.to_envelope()["error"]["code"] == "session_conflict"


def test_unknown_session_past_position_zero_is_a_conflict_with_a_hint():
    with pytest.raises(SessionConflict, match="unknown session 'nope' at position 3") as info:
        SessionStore().acquire("nope", "slot", 3, now=0.0)
    assert "replay it from position 0" in info.value.hint


def test_slots_keep_separate_sessions():
    store = SessionStore()
    store.commit(store.acquire("s1", "a", 0, now=0.0), 4)
    store.acquire("s1", "b", 0, now=0.0)
    assert len(store) == 2
    assert store.acquire("s1", "a", 4, now=0.0).length == 4
    with pytest.raises(SessionConflict):
        store.acquire("s1", "b", 4, now=0.0)


def test_ttl_expiry_with_explicit_now():
    store = SessionStore(ttl_s=10.0)
    store.commit(store.acquire("s1", "slot", 0, now=100.0), 5)
    assert store.acquire("s1", "slot", 5, now=110.0).length == 5  # exactly ttl_s idle: still alive
    with pytest.raises(SessionConflict, match="unknown session 's1'"):
        store.acquire("s1", "slot", 5, now=120.5)  # 10.5 s idle since last use at 110
    assert len(store) == 0


def test_expire_returns_the_count_dropped():
    store = SessionStore(ttl_s=5.0)
    store.acquire("old", "slot", 0, now=0.0)
    store.acquire("new", "slot", 0, now=4.0)
    assert store.expire(now=6.0) == 1
    assert len(store) == 1


def test_a_live_session_is_never_evicted_and_a_new_one_is_refused_at_the_cap():
    store = SessionStore(max_bytes=1000)
    a = store.acquire("a", "slot", 0, now=0.0)
    fill(a, 500)  # 1000 bytes of keys and values: the cap
    store.commit(a, 7)
    with pytest.raises(SessionCacheFull, match="new session 'b' refused") as info:
        store.acquire("b", "slot", 0, now=1.0)
    assert info.value.status == 503 and info.value.code == "session_cache_full"
    assert "--session-cache-mb" in info.value.hint
    assert store.acquire("a", "slot", 7, now=2.0) is a  # A's next step still finds its cache
    assert len(store) == 1 and store.nbytes == 1000


def test_room_comes_back_when_a_session_is_released_or_expires():
    store = SessionStore(max_bytes=1000, ttl_s=10.0)
    a = store.acquire("a", "slot", 0, now=0.0)
    fill(a, 500)
    store.commit(a, 1)
    store.release("a")
    assert store.acquire("b", "slot", 0, now=1.0).length == 0  # released: room again
    b = store.acquire("b", "slot", 0, now=1.0)
    fill(b, 500)
    store.commit(b, 1)
    with pytest.raises(SessionCacheFull):
        store.acquire("c", "slot", 0, now=5.0)
    assert store.acquire("c", "slot", 0, now=11.5).length == 0  # b idle 10.5 s: expired, c admitted
    assert store.nbytes == 0 and len(store) == 1


def test_restarting_a_session_at_zero_gives_back_its_own_bytes_first():
    store = SessionStore(max_bytes=1000)
    a = store.acquire("a", "slot", 0, now=0.0)
    fill(a, 500)
    store.commit(a, 1)
    assert store.acquire("a", "slot", 0, now=1.0).length == 0  # a replay restarts it under the cap


def test_an_admitted_session_may_grow_past_the_cap():
    store = SessionStore(max_bytes=100)
    session = store.acquire("big", "slot", 0, now=0.0)
    fill(session, 400)
    store.commit(session, 1)
    assert len(store) == 1 and store.nbytes == 800 and store.bytes_left == 0
    assert store.acquire("big", "slot", 1, now=1.0) is session


@pytest.mark.parametrize("kw", [{"ttl_s": 0}, {"max_bytes": 0}, {"max_bytes": -1}])
def test_store_limits_must_be_positive(kw):
    with pytest.raises(ValueError, match="must be > 0"):
        SessionStore(**kw)


def test_release_drops_every_slot_of_a_session():
    store = SessionStore()
    store.acquire("s1", "a", 0, now=0.0)
    store.acquire("s1", "b", 0, now=0.0)
    store.acquire("s2", "a", 0, now=0.0)
    assert store.release("s1") == 2
    assert store.release("s1") == 0
    assert len(store) == 1


def test_release_slot_drops_every_session_of_a_slot():
    store = SessionStore()
    store.acquire("s1", "a", 0, now=0.0)
    store.acquire("s2", "a", 0, now=0.0)
    store.acquire("s1", "b", 0, now=0.0)
    store.release_slot("a")
    assert len(store) == 1


def test_a_session_released_while_its_forward_runs_leaves_no_bytes_behind():
    """A frozen node resumes: its late forward commits after the entry's release was served."""
    store = SessionStore()
    session = store.acquire("s1", "slot", 0, now=0.0)
    assert store.release("s1") == 1 and store.nbytes == 0
    fill(session, 4096)  # the forward that was running writes its keys and values
    store.commit(session, 3)
    assert store.nbytes == 0 and len(store) == 0 and store.bytes_left == store.max_bytes


def test_an_ended_session_is_not_started_again_by_a_late_first_chunk_until_the_ttl():
    store = SessionStore(ttl_s=10.0)
    store.commit(store.acquire("s1", "slot", 0, now=0.0), 5)
    assert store.end("s1", now=1.0) == 1 and len(store) == 0
    with pytest.raises(SessionConflict, match="was ended by its entry node"):
        store.acquire("s1", "slot", 0, now=2.0)  # a frozen node resumes and runs its queued chunk 0
    assert len(store) == 0 and store.nbytes == 0
    store.acquire("s2", "slot", 0, now=2.0)     # other sessions are not affected
    assert store.acquire("s1", "slot", 0, now=11.5).length == 0  # the tombstone expired with the TTL


def test_an_ended_session_is_known_as_ended_for_the_ttl():
    store = SessionStore(ttl_s=10.0)
    store.acquire("s", "slot", 0, now=100.0)
    assert not store.was_ended("s", now=100.0)
    store.end("s", now=101.0)
    assert store.was_ended("s", now=105.0) and store.was_ended("s", now=111.0)
    assert not store.was_ended("s", now=111.5) and not store.was_ended("other", now=105.0)
