"""What runs on every step of a node: the forward entry points, the batched compute, and the
KV-cache sessions it reads and writes.

A forward call names the layers to run; the runtime picks the slot (:mod:`meshnet.node.slots`)
whose range contains them (a hop may start inside a shard, ADR-0012). Compute is serialised per
node with one lock (torch already uses every core for one forward), but concurrent callers do
not queue one by one: their steps meet in a :class:`~meshnet.node.batching.StepBatcher`, and the
decode steps of different sessions run as one batched forward (ADR-0052).

Sessions: one generation's KV cache per slot, admitted under a memory cap, expired by TTL,
never evicted live.

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

import collections
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from meshnet.errors import InvalidRequest, MeshnetError, NotFound, SessionConflict, Unavailable
from meshnet.layers import LayerRange
from meshnet.models.kernels import KVCache
from meshnet.node.batching import Step, StepBatcher
from meshnet.node.settings import NodeSettings
from meshnet.node.slots import ShardSlot, SlotHolder
from meshnet.presets import canonical_model_name

log = logging.getLogger(__name__)

DEFAULT_BATCH_WINDOW_S = NodeSettings.batch_window_s  # one place for defaults: the node's settings
DEFAULT_MAX_BATCH_SIZE = NodeSettings.max_batch_size

HIDDEN, TOKENS, HEAD = "hidden", "tokens", "head"  # what a step's inputs are (see _Work)


@dataclass(frozen=True)
class _Work:
    """What one step runs, by ``kind``: ``hidden`` states ``[1, seq, hidden]`` through ``layers``;
    token ids ``[1, seq]`` (``tokens``), embedded first; or the last hidden state ``[1, 1, hidden]``
    through the final norm and LM head (``head``: no layers, no session cache)."""

    slot: ShardSlot
    layers: LayerRange
    position: int
    inputs: torch.Tensor
    kind: str = HIDDEN
    #: a speculative step: the session may first go back to ``position`` (:meth:`SessionStore.acquire`)
    rewind: bool = False


def _compute(works: list[_Work], sessions: list[Session]) -> list[torch.Tensor]:
    """Run steps of one group (same slot, layers and kind): one step as it is, several decode
    steps as one :meth:`ShardModel.forward_batch`, head steps as one LM-head matmul. Returns each
    step's ``[1, seq, hidden]`` (``[1, 1, vocab]`` float32 logits for head steps)."""
    first = works[0]
    shard = first.slot.shard
    if first.kind == HEAD:  # a step's rows are its positions (one for a decode step, more for scoring)
        return list(shard.logits(torch.cat([w.inputs for w in works])).split([len(w.inputs) for w in works]))
    if len(works) == 1:
        inputs = shard.embed_tokens(first.inputs, first.position) if first.kind == TOKENS else first.inputs
        return [shard.forward(inputs, sessions[0].cache, first.position, first.layers)]
    positions = [w.position for w in works]
    if first.kind == TOKENS:
        hidden = shard.embed_tokens(torch.cat([w.inputs for w in works]), positions)
    else:
        hidden = torch.cat([w.inputs.to(shard.dtype) for w in works])
    out = shard.forward_batch(hidden, [s.cache for s in sessions], positions, first.layers)
    return list(out.split(1))


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
        ``position`` on (the drafts the entry rejected), at most ``kernels.MAX_REWIND`` of them.

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


class NodeRuntime(SlotHolder):
    """Slots plus sessions of one node.

    Args:
        max_loaded_shards: slot count (>= 1).
        compute_dtype: ``float32``, ``bfloat16`` (``float16`` on a GPU); ``device``: ``cpu``, ``cuda:N``.
        sessions: the KV-cache session store.
        batch_window_s, max_batch_size: decode batching (:class:`meshnet.node.batching.StepBatcher`):
            longest wait for other sessions' steps, seconds, and most steps per forward.

    Raises:
        InvalidRequest: ``max_loaded_shards`` < 1. ValueError: a batching setting out of range.
    """

    def __init__(self, *, max_loaded_shards: int = 1, compute_dtype: str = "float32", device: str = "cpu",
                 sessions: SessionStore | None = None, batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> None:
        if max_loaded_shards < 1:
            raise InvalidRequest("max_loaded_shards must be >= 1")
        self.max_loaded_shards = max_loaded_shards
        self.compute_dtype, self.device = compute_dtype, device
        self.sessions = sessions if sessions is not None else SessionStore()  # an empty store is falsy
        self.slots: dict[str, ShardSlot] = {}
        #: (model as asked, start, end) -> the slot :meth:`find_slot` found; emptied when a slot comes or goes
        self._found: dict[tuple, ShardSlot] = {}
        self.lock = threading.Lock()  # the compute lock: one batch (or doctor run) at a time, and the session store
        self.tokens_processed = 0
        self.batcher = StepBatcher(self._run_batch, window_s=batch_window_s, max_batch=max_batch_size)
        #: (monotonic time, steps) of each forward run, newest last (the console reads it)
        self.batch_sizes: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
        #: called with the size of each forward run, outside the compute lock (the node's metrics)
        self.on_batch: Callable[[int], None] | None = None

    def find_slot(self, model: str | None, layers: LayerRange) -> ShardSlot:
        """The slot of ``model`` whose range contains ``layers``.

        Raises:
            NotFound: no loaded shard covers the requested layers.
        """
        found = self._found.get((model, layers.start, layers.end))  # every step asks: no name lookup then
        if found is not None:
            return found
        asked, model = model, None if model is None else canonical_model_name(model)
        for slot in self.slots.values():
            if (model is None or slot.model == model) and slot.layers.contains_range(layers):
                self._found[(asked, layers.start, layers.end)] = slot
                return slot
        held = ", ".join(f"{s.model} {s.layers}" for s in self.slots.values()) or "nothing"
        raise NotFound(f"no loaded shard serves layers {layers} of {model or 'any model'} (holding {held})",
                       code="shard_not_loaded")

    # ---- compute ----------------------------------------------------------------------

    def forward(self, *, model: str | None, session_id: str, layers: LayerRange, position: int,
                hidden: torch.Tensor, rewind: bool = False) -> torch.Tensor:
        """Run ``layers`` on ``hidden`` ``[batch, seq, hidden]`` for one session.

        Thread-safe; blocks until the step has run. A decode step (``seq == 1``) runs batched
        with the steps of other sessions that reach this node at about the same time (ADR-0052).

        ``rewind``: a speculative step, which may first take the session back to ``position``
        (:meth:`SessionStore.acquire`, ADR-0058).

        Returns hidden states ``[batch, seq, hidden]`` in the compute dtype.

        Raises:
            NotFound, SessionConflict, SessionCacheFull, InvalidRequest; MeshnetError
            ``forward_failed`` (the session was dropped).
        """
        return self.batcher.submit(self._hidden_step(model, session_id, layers, position, hidden, rewind))

    async def forward_async(self, *, model: str | None, session_id: str, layers: LayerRange, position: int,
                            hidden: torch.Tensor, rewind: bool = False) -> torch.Tensor:
        """:meth:`forward` for an event loop, which never computes: the step is queued without
        blocking and runs in the batcher's runner thread, batched with others' (ADR-0049). Same
        results and errors."""
        return await self._run_async(self._hidden_step(model, session_id, layers, position, hidden, rewind))

    async def _run_async(self, step: Step) -> torch.Tensor:
        """``step`` queued from the calling loop and run by the batcher's runner thread
        (:meth:`StepBatcher.submit_soon`); the loop only waits (ADR-0049)."""
        return await self.batcher.submit_soon(step)

    def _hidden_step(self, model: str | None, session_id: str, layers: LayerRange, position: int,
                     hidden: torch.Tensor, rewind: bool = False) -> Step:
        slot = self.find_slot(model, layers)
        size = slot.shard.config.hidden_size
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] < 1 or hidden.shape[-1] != size:
            raise InvalidRequest(f"activation shape {list(hidden.shape)} does not match [1, seq >= 1, {size}]")
        return Step(session_id, (slot.key, layers, HIDDEN), hidden.shape[1],
                    _Work(slot, layers, position, hidden, rewind=rewind))

    def run_entry(self, slot: ShardSlot, session_id: str, input_ids: torch.Tensor, position: int,
                  layers: LayerRange, rewind: bool = False) -> torch.Tensor:
        """Embed ``input_ids`` ``[1, seq]`` and run this node's entry ``layers`` (thread-safe,
        batched like :meth:`forward`; ``rewind`` as there)."""
        return self.batcher.submit(self._entry_step(slot, session_id, input_ids, position, layers, rewind))

    async def run_entry_async(self, slot: ShardSlot, session_id: str, input_ids: torch.Tensor, position: int,
                              layers: LayerRange, rewind: bool = False) -> torch.Tensor:
        """:meth:`run_entry` for an event loop (see :meth:`forward_async`)."""
        return await self._run_async(self._entry_step(slot, session_id, input_ids, position, layers, rewind))

    @staticmethod
    def _entry_step(slot: ShardSlot, session_id: str, input_ids: torch.Tensor, position: int,
                    layers: LayerRange, rewind: bool = False) -> Step:
        return Step(session_id, (slot.key, layers, TOKENS), input_ids.shape[1],
                    _Work(slot, layers, position, input_ids, TOKENS, rewind))

    def logits(self, slot: ShardSlot, session_id: str, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of entry ``slot`` on the hidden states ``hidden`` ``[1, n,
        hidden]`` of one session (n = 1 for a decode step, more to score a prompt's positions);
        ``[n, 1, vocab]`` float32. Thread-safe; batched with the other sessions' head steps like
        decode steps (ADR-0052): one step of a session per batch, and once the session is
        forgotten (:meth:`StepBatcher.forget`) no batch waits for its next.

        Raises:
            InvalidRequest: ``slot`` holds no LM head, or ``hidden`` is not ``[1, n, hidden]``.
        """
        return self.batcher.submit(self._head_step(slot, session_id, hidden))

    async def logits_async(self, slot: ShardSlot, session_id: str, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`logits` for an event loop (see :meth:`forward_async`)."""
        return await self._run_async(self._head_step(slot, session_id, hidden))

    @staticmethod
    def _head_step(slot: ShardSlot, session_id: str, hidden: torch.Tensor) -> Step:
        if slot.shard.lm_head is None:
            raise InvalidRequest(f"{slot.key} holds no LM head (not an entry shard)")
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] < 1:
            raise InvalidRequest(f"the LM head takes positions [1, n, hidden], got {list(hidden.shape)}")
        rows = hidden.transpose(0, 1).to(slot.shard.dtype)  # [n, 1, hidden]: positions as rows of the batch
        return Step(session_id, (slot.key, HEAD), 1, _Work(slot, slot.layers, 0, rows, HEAD))

    def _run_batch(self, steps: list[Step]) -> None:
        """Run one batch of steps of one group under the compute lock (:meth:`_run_locked`), then
        tell ``on_batch`` its size (forwards through layers only)."""
        with self.lock:
            size = self._run_locked(steps)
        if size and self.on_batch is not None:
            self.on_batch(size)

    def _run_locked(self, steps: list[Step]) -> int:
        """Admit, run and commit one batch of steps of one group; the caller holds the compute lock.
        Returns how many steps ran through layers (0 for LM-head steps and refused batches).

        A step whose session is refused (:meth:`SessionStore.acquire`) fails alone; the others
        run. An unexpected compute error drops every session of the batch (their caches may be
        half-written) and fails each step with ``forward_failed``.
        """
        if steps[0].work.kind == HEAD:
            self._run_heads(steps)
            return 0
        admitted: list[tuple[Step, Session]] = []
        for step in steps:
            try:
                admitted.append((step, self.sessions.acquire(step.session_id, step.work.slot.key,
                                                             step.work.position, rewind=step.work.rewind)))
            except MeshnetError as exc:
                step.fail(exc)
        if not admitted:
            return 0
        try:
            outs = _compute([step.work for step, _ in admitted], [session for _, session in admitted])
        except MeshnetError as exc:
            for step, _ in admitted:
                step.fail(exc)
            return 0
        except Exception as exc:
            key = admitted[0][0].work.slot.key
            log.exception("forward failed on %s (batch of %d)", key, len(admitted))
            for step, _ in admitted:
                self.sessions.release(step.session_id)
                step.fail(MeshnetError(f"forward failed on {key}: {type(exc).__name__}: {exc}",
                                       code="forward_failed",
                                       hint="the session was dropped; replay it from position 0"))
            return 0
        for (step, session), out in zip(admitted, outs):
            self.sessions.commit(session, step.tokens)
            self.tokens_processed += step.tokens
            step.finish(out)
        self.batch_sizes.append((time.monotonic(), len(admitted)))
        return len(admitted)

    def _run_heads(self, steps: list[Step]) -> None:
        """LM-head steps: one matmul for all, no session touched (not counted in
        :attr:`batch_sizes`, which counts forwards through layers); the caller holds the compute lock."""
        try:
            outs = _compute([step.work for step in steps], [])
        except Exception as exc:
            key = steps[0].work.slot.key
            log.exception("LM head failed on %s (batch of %d)", key, len(steps))
            for step in steps:
                step.fail(MeshnetError(f"LM head failed on {key}: {type(exc).__name__}: {exc}",
                                       code="forward_failed"))
            return
        for step, out in zip(steps, outs):
            step.finish(out)
