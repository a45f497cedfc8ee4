"""KV-cache sessions on a node, expiring by TTL and evicted LRU under a memory cap.

A session is one generation's KV cache for one shard slot, keyed by the session id the
orchestrator sends in ``X-Meshnet-Session``. Position 0 (re)starts a session; any other
position must equal the cached length, so a lost or evicted session surfaces as a clear
409 instead of silently wrong attention.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from meshnet.errors import MeshnetError
from meshnet.models.shard import KVCache


class SessionConflict(MeshnetError):
    """Position does not continue the cached session (expired, evicted or out of order)."""

    status = 409
    code = "session_conflict"
    type = "invalid_request_error"


@dataclass
class Session:
    cache: KVCache = field(default_factory=KVCache)
    length: int = 0            # tokens cached
    last_used_s: float = 0.0   # monotonic seconds


class SessionStore:
    """Sessions keyed by ``(session_id, slot_key)``.

    Args:
        ttl_s: idle seconds after which a session expires (default 300 s).
        max_bytes: cap on the bytes held by all KV caches; least recently used sessions are
            evicted past it (default 1 GiB).
    """

    def __init__(self, ttl_s: float = 300.0, max_bytes: int = 1 << 30) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()

    def acquire(self, session_id: str, slot_key: str, position: int, now: float | None = None) -> Session:
        """Session to run ``position..``; position 0 starts it afresh.

        Raises:
            SessionConflict: ``position`` differs from the cached length.
        """
        now = time.monotonic() if now is None else now
        self.expire(now)
        key = (session_id, slot_key)
        if position == 0:
            self._sessions[key] = Session(last_used_s=now)
        session = self._sessions.get(key)
        if session is None:
            raise SessionConflict(f"unknown session {session_id!r} at position {position}",
                                  hint="the session expired or was evicted; replay it from position 0")
        if session.length != position:
            raise SessionConflict(f"session {session_id!r} holds {session.length} tokens, "
                                  f"request is at position {position}")
        session.last_used_s = now
        self._sessions.move_to_end(key)
        return session

    def commit(self, session: Session, n_tokens: int) -> None:
        """Record ``n_tokens`` more cached tokens and enforce the memory cap."""
        session.length += n_tokens
        self.evict_to_cap()

    def release(self, session_id: str) -> int:
        """Drop every slot's cache of ``session_id``; returns how many were dropped."""
        keys = [k for k in self._sessions if k[0] == session_id]
        for key in keys:
            del self._sessions[key]
        return len(keys)

    def release_slot(self, slot_key: str) -> None:
        for key in [k for k in self._sessions if k[1] == slot_key]:
            del self._sessions[key]

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        stale = [k for k, s in self._sessions.items() if now - s.last_used_s > self.ttl_s]
        for key in stale:
            del self._sessions[key]
        return len(stale)

    def evict_to_cap(self) -> int:
        evicted = 0
        while len(self._sessions) > 1 and self.nbytes > self.max_bytes:
            self._sessions.popitem(last=False)
            evicted += 1
        return evicted

    @property
    def nbytes(self) -> int:
        return sum(s.cache.nbytes for s in self._sessions.values())

    @property
    def bytes_left(self) -> int:
        """Cache space left under the cap, in bytes."""
        return max(0, self.max_bytes - self.nbytes)

    def __len__(self) -> int:
        return len(self._sessions)
