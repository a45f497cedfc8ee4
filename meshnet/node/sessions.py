"""KV-cache sessions of a node: one generation's cache per shard slot.

A session is one generation's KV cache for one shard slot, keyed by the session id the
orchestrator sends in ``X-Meshnet-Session``. Position 0 (re)starts a session; any other
position must equal the cached length, so a lost or expired session surfaces as a clear
409 instead of silently wrong attention.

A session is *in use* from its position-0 call until it is released (``DELETE
/v1/sessions/{id}``) or stays idle for more than ``ttl_s``. A session in use is never
evicted: the memory cap is enforced when a session starts, not by dropping another
generation half-way. When the cap is reached a new session is refused with 503
``session_cache_full`` (the entry node then tries another holder of the layers); a
session already admitted may still grow past the cap; new ones are refused until releases
or expiry bring the total back under it (ADR-0031).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from meshnet.errors import SessionConflict, Unavailable
from meshnet.models.caches import KVCache


class SessionCacheFull(Unavailable):
    """No room under the node's session memory cap for a new session (HTTP 503, try another node)."""

    code = "session_cache_full"


@dataclass
class Session:
    cache: KVCache = field(default_factory=KVCache)
    length: int = 0            # tokens cached
    last_used_s: float = 0.0   # monotonic seconds
    nbytes: int = 0            # cache bytes as of the last commit
    released: bool = False     # dropped from the store (a forward still running on it counts nothing)


class SessionStore:
    """Sessions keyed by ``(session_id, slot_key)``, kept in least-recently-used order.

    The per-token path stays O(1) in the number of sessions: expiry pops from the old end
    until it meets a live session, and the byte total is updated by each commit's delta.

    Args:
        ttl_s: idle seconds after which a session expires (default 300 s); > 0.
        max_bytes: cap on the bytes held by all KV caches (default 1 GiB); > 0. A new session
            is refused while the total is at or over it; live sessions are never evicted.

    Raises:
        ValueError: ``ttl_s`` or ``max_bytes`` not positive.
    """

    def __init__(self, ttl_s: float = 300.0, max_bytes: int = 1 << 30) -> None:
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError(f"session ttl_s and max_bytes must be > 0, got {ttl_s} and {max_bytes}")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._nbytes = 0
        self._ended: OrderedDict[str, float] = OrderedDict()  # session id -> when its entry ended it
        self._ended_lock = threading.Lock()  # the tombstones are written from event loops too

    def acquire(self, session_id: str, slot_key: str, position: int, now: float | None = None,
                rewind: bool = False) -> Session:
        """Session to run ``position..``; position 0 starts it afresh. With ``rewind`` (a speculative
        step, ADR-0058) a ``position`` below the cached length first forgets the positions from
        ``position`` on (the drafts the entry rejected), at most ``caches.MAX_REWIND`` of them.

        Raises:
            SessionCacheFull: position 0 while the cached bytes are at or over ``max_bytes``
                (an existing session restarted at 0 first gives back its own bytes).
            SessionConflict: ``position`` differs from the cached length (and is no allowed
                rewind), or position 0 of a session its entry ended (:meth:`end`) less than
                ``ttl_s`` ago.
        """
        now = time.monotonic() if now is None else now
        self.expire(now)
        key = (session_id, slot_key)
        if position == 0 and session_id in self._ended:
            raise SessionConflict(f"session {session_id!r} was ended by its entry node",
                                  hint="a late call of a generation that is over (or failed over); nothing to do")
        if position == 0:
            self._drop(key)
            self.check_room(session_id, now)
            self._sessions[key] = Session(last_used_s=now)
        session = self._sessions.get(key)
        if session is None:
            raise SessionConflict(f"unknown session {session_id!r} at position {position}",
                                  hint="the session expired or was released; replay it from position 0")
        if rewind and 0 < position < session.length:
            try:
                session.cache.rewind(session.length - position)
            except ValueError as exc:
                raise SessionConflict(f"session {session_id!r} cannot go back from {session.length} to "
                                      f"position {position}: {exc}",
                                      hint="replay the session from position 0 without speculation") from None
            session.length = position
        if session.length != position:
            raise SessionConflict(f"session {session_id!r} holds {session.length} tokens, "
                                  f"request is at position {position}")
        session.last_used_s = now
        self._sessions.move_to_end(key)
        return session

    def check_room(self, session_id: str = "", now: float | None = None) -> None:
        """Expire idle sessions, then check that a new session may start.

        Raises:
            SessionCacheFull: the live sessions hold ``max_bytes`` or more.
        """
        self.expire(now)
        if self._nbytes >= self.max_bytes:
            raise SessionCacheFull(
                f"session cache full: {self._nbytes} of {self.max_bytes} bytes held by {len(self)} live "
                f"session(s); new session{f' {session_id!r}' if session_id else ''} refused",
                hint="another node holding these layers can take it; or raise --session-cache-mb "
                     "(MESHNET_SESSION_CACHE_MB) on this node")

    def commit(self, session: Session, n_tokens: int) -> None:
        """Record ``n_tokens`` more cached tokens and the cache's new size (bytes).

        Never evicts: a live session may grow past ``max_bytes``; new ones are then refused. A
        session released while its forward ran (a late call from an abandoned hop) counts nothing:
        its bytes left the total when it was dropped.
        """
        session.length += n_tokens
        if session.released:
            return
        size = session.cache.nbytes
        self._nbytes += size - session.nbytes
        session.nbytes = size

    def _drop(self, key: tuple[str, str]) -> None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self._nbytes -= session.nbytes
            session.released = True

    def release(self, session_id: str) -> int:
        """Drop every slot's cache of ``session_id``; returns how many were dropped."""
        keys = [k for k in self._sessions if k[0] == session_id]
        for key in keys:
            self._drop(key)
        return len(keys)

    def end(self, session_id: str, now: float | None = None) -> int:
        """Release ``session_id`` for good (its entry says the generation is over here); returns
        how many caches were dropped.

        For ``ttl_s`` afterwards a call that would start it again (position 0) is refused: a node
        that was frozen and resumes may still run the calls it had queued, and a late first chunk
        must not rebuild a cache that nobody will use or release (docs/adr/0036-hop-deadlines.md).
        """
        self.mark_ended(session_id, now)
        return self.release(session_id)

    def mark_ended(self, session_id: str, now: float | None = None) -> None:
        """Record that the entry ended ``session_id`` (the tombstone of :meth:`end`) without touching
        its caches: safe from any thread while a batch runs, so a step of it still queued is refused
        whoever takes the compute lock first."""
        with self._ended_lock:
            self._ended[session_id] = time.monotonic() if now is None else now
            self._ended.move_to_end(session_id)

    def was_ended(self, session_id: str, now: float | None = None) -> bool:
        """Whether the entry ended ``session_id`` here less than ``ttl_s`` ago (:meth:`end`). A
        read only (one dict lookup): safe from the event loop while a batch runs."""
        at = self._ended.get(session_id)
        return at is not None and (time.monotonic() if now is None else now) - at <= self.ttl_s

    def release_slot(self, slot_key: str) -> None:
        for key in [k for k in self._sessions if k[1] == slot_key]:
            self._drop(key)

    def expire(self, now: float | None = None) -> int:
        """Drop sessions idle for more than ``ttl_s``; returns how many."""
        now = time.monotonic() if now is None else now
        with self._ended_lock:
            while self._ended and now - next(iter(self._ended.values())) > self.ttl_s:
                self._ended.popitem(last=False)
        expired = 0
        while self._sessions:
            key, oldest = next(iter(self._sessions.items()))
            if now - oldest.last_used_s <= self.ttl_s:
                break
            self._drop(key)
            expired += 1
        return expired

    @property
    def nbytes(self) -> int:
        """Bytes held by all sessions' KV caches (as of their last commit)."""
        return self._nbytes

    @property
    def bytes_left(self) -> int:
        """Cache space left under the cap, in bytes."""
        return max(0, self.max_bytes - self._nbytes)

    def __len__(self) -> int:
        return len(self._sessions)
