"""What runs on every step of a node: the forward entry points, the batched compute, and the
KV-cache sessions it reads and writes.

A forward call names the layers to run; the runtime picks the slot (:mod:`meshnet.node.slots`)
whose range contains them (a hop may start inside a shard, ADR-0012). Compute is serialised per
node with one lock (torch already uses every core for one forward), but concurrent callers do
not queue one by one: their steps meet in a :class:`~meshnet.node.batching.StepBatcher`, and the
decode steps of different sessions run as one batched forward (ADR-0052).

Sessions (one generation's KV cache per slot, admitted under a memory cap, expired by TTL, never
evicted live) are kept by :class:`meshnet.node.sessions.SessionStore`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from meshnet.errors import InvalidRequest, MeshnetError, NotFound
from meshnet.layers import LayerRange
from meshnet.node.batching import Step, StepBatcher
from meshnet.node.settings import NodeSettings
from meshnet.node.sessions import Session, SessionStore
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
    steps as one :meth:`ShardModel.forward_batch`, decode and speculative steps together as one
    packed :meth:`ShardModel.forward_packed`, head steps as one LM-head matmul. Returns each
    step's ``[1, seq, hidden]`` (``[1, 1, vocab]`` float32 logits for head steps)."""
    first = works[0]
    shard = first.slot.shard
    if first.kind == HEAD:  # a step's rows are its positions (one for a decode step, more for scoring)
        return list(shard.logits(torch.cat([w.inputs for w in works])).split([len(w.inputs) for w in works]))
    if len(works) == 1:
        inputs = shard.embed_tokens(first.inputs, first.position) if first.kind == TOKENS else first.inputs
        return [shard.forward(inputs, sessions[0].cache, first.position, first.layers)]
    positions = [w.position for w in works]
    q_lens = [w.inputs.shape[1] for w in works]
    if any(q > 1 for q in q_lens):  # speculative steps among them: one packed row (ADR-0058)
        if first.kind == TOKENS:
            hidden = torch.cat([shard.embed_tokens(w.inputs, w.position) for w in works], dim=1)
        else:
            hidden = torch.cat([w.inputs.to(shard.dtype) for w in works], dim=1)
        out = shard.forward_packed(hidden, [s.cache for s in sessions], positions, q_lens, first.layers)
        return list(out.split(q_lens, dim=1))
    if first.kind == TOKENS:
        hidden = shard.embed_tokens(torch.cat([w.inputs for w in works]), positions)
    else:
        hidden = torch.cat([w.inputs.to(shard.dtype) for w in works])
    out = shard.forward_batch(hidden, [s.cache for s in sessions], positions, first.layers)
    return list(out.split(1))


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
                    _Work(slot, layers, position, hidden, rewind=rewind), decode=hidden.shape[1] == 1 or rewind)

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
                    _Work(slot, layers, position, input_ids, TOKENS, rewind), decode=input_ids.shape[1] == 1 or rewind)

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
