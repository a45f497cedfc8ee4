"""Shard slots: the loaded shard backends of one node, and the forward entry point.

A node holds up to ``max_loaded_shards`` slots; each slot is one :class:`ShardModel`
(one model, one layer range, one recipe). A forward call names the layers to run; the
runtime picks the slot whose range contains them (a hop may start inside a shard,
ADR-0012). Compute is serialised per node with one lock: torch already uses every core
for one forward, and the pipeline overlaps work across nodes, not within one.

Each load measures the shard's resident memory (ADR-0039): the process RSS after the shard is
built and has run one warm-up forward, minus the RSS just before, with transformers' modeling
code imported and run once beforehand so its fixed cost is not charged to the first shard. doctor reports
the figure and the tracker budgets with it where it exceeds the preset.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshnet.errors import InvalidRequest, MeshnetError, NotFound
from meshnet.layers import LayerRange
from meshnet.models.shard import KVCache, ShardModel, trim_heap, warm_runtime
from meshnet.node.hardware import rss_bytes
from meshnet.presets import canonical_model_name
from meshnet.node.sessions import SessionStore
from meshnet.protocol.control import CapabilityReport, ShardInfo

log = logging.getLogger(__name__)


@dataclass
class ShardSlot:
    """One loaded shard backend; ``resident_bytes`` is its measured memory (see :func:`measure_load`)."""

    model: str
    layers: LayerRange
    quantization: str
    shard: ShardModel
    tier: str = "pinned"
    resident_bytes: int = 0
    loaded_at: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        return f"{self.model}:{self.layers.start}-{self.layers.end}"

    def describe(self, report: CapabilityReport | None = None) -> ShardInfo:
        """This slot as the node reports it to the tracker (with its latest capability report)."""
        start, end = self.layers.to_inclusive()
        return ShardInfo(model=self.model, shard_start=start, shard_end=end, tier=self.tier,
                         quantization=self.quantization, weight_bytes=self.shard.weight_bytes(),
                         entry=self.shard.is_entry, num_layers=self.shard.num_layers, report=report)


WARM_UP_TOKENS = 16


def measure_load(build, dtype: str) -> tuple[ShardModel, int]:
    """Build a shard with ``build()`` and measure its resident memory, bytes.

    The figure is the process RSS after the build, one ``WARM_UP_TOKENS``-token forward on a
    throwaway cache (the compute's lasting buffers) and :func:`trim_heap`, minus the RSS just
    before the build. The process's fixed costs are paid first (:func:`warm_runtime` in compute
    dtype ``dtype``: transformers' modeling code, the kernels' first run). It is
    never below the shard's :meth:`ShardModel.weight_bytes` (page reuse can hide a small shard).
    Concurrent work in the process (another slot's sessions growing) adds to it: the figure errs
    high, the safe side for placement. Errors of ``build`` propagate.
    """
    warm_runtime(dtype)
    trim_heap()
    before = rss_bytes()
    shard = build()
    with torch.inference_mode():
        hidden = torch.zeros(1, WARM_UP_TOKENS, shard.config.hidden_size)
        shard.forward(hidden, KVCache(), 0)
    trim_heap()
    return shard, max(rss_bytes() - before, shard.weight_bytes())


class NodeRuntime:
    """Slots plus sessions of one node.

    Args:
        max_loaded_shards: slot count (>= 1).
        compute_dtype: ``float32`` or ``bfloat16``.
        sessions: the KV-cache session store.
    """

    def __init__(self, *, max_loaded_shards: int = 1, compute_dtype: str = "float32",
                 sessions: SessionStore | None = None) -> None:
        if max_loaded_shards < 1:
            raise InvalidRequest("max_loaded_shards must be >= 1")
        self.max_loaded_shards = max_loaded_shards
        self.compute_dtype = compute_dtype
        self.sessions = sessions if sessions is not None else SessionStore()  # an empty store is falsy
        self.slots: dict[str, ShardSlot] = {}
        self.lock = threading.Lock()
        self.tokens_processed = 0
        self.batch_sizes: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)

    # ---- slot lifecycle ---------------------------------------------------------------

    def load(self, model: str, model_path: Path, layers: LayerRange, *, quantization: str = "bfloat16",
             tier: str = "pinned") -> ShardSlot:
        """Load a shard into a free slot (blocking; seconds for real weights).

        Raises:
            MeshnetError: no free slot.
        """
        model = canonical_model_name(model)
        for slot in self.slots.values():
            if slot.model == model and slot.layers == layers:
                return slot
        if len(self.slots) >= self.max_loaded_shards:
            raise MeshnetError(f"no free shard slot ({len(self.slots)}/{self.max_loaded_shards} used)",
                               code="no_free_slot", status=409)
        shard, resident = measure_load(lambda: ShardModel(model_path, layers, dtype=self.compute_dtype,
                                                          quantization=quantization), self.compute_dtype)
        slot = ShardSlot(model=model, layers=layers, quantization=quantization, shard=shard, tier=tier,
                         resident_bytes=resident)
        with self.lock:
            self.slots[slot.key] = slot
        log.info("loaded %s layers %s (%d bytes of weights, %d resident)", model, layers,
                 shard.weight_bytes(), resident)
        return slot

    def drop(self, model: str, layers: LayerRange) -> ShardSlot | None:
        """Free a slot's weights and its sessions; the slot dropped (its ``key`` names its reports),
        None when it was not loaded."""
        key = f"{canonical_model_name(model)}:{layers.start}-{layers.end}"
        with self.lock:
            slot = self.slots.pop(key, None)
            if slot is not None:
                self.sessions.release_slot(key)
        return slot

    def find_slot(self, model: str | None, layers: LayerRange) -> ShardSlot:
        """The slot of ``model`` whose range contains ``layers``.

        Raises:
            NotFound: no loaded shard covers the requested layers.
        """
        model = None if model is None else canonical_model_name(model)
        for slot in self.slots.values():
            if (model is None or slot.model == model) and slot.layers.contains_range(layers):
                return slot
        held = ", ".join(f"{s.model} {s.layers}" for s in self.slots.values()) or "nothing"
        raise NotFound(f"no loaded shard serves layers {layers} of {model or 'any model'} (holding {held})",
                       code="shard_not_loaded")

    # ---- compute ----------------------------------------------------------------------

    def forward(self, *, model: str | None, session_id: str, layers: LayerRange, position: int,
                hidden: torch.Tensor) -> torch.Tensor:
        """Run ``layers`` on ``hidden`` ``[batch, seq, hidden]`` for one session.

        Returns hidden states ``[batch, seq, hidden]`` in the compute dtype.

        Raises:
            NotFound, SessionConflict, InvalidRequest.
        """
        slot = self.find_slot(model, layers)
        size = slot.shard.config.hidden_size
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] < 1 or hidden.shape[-1] != size:
            raise InvalidRequest(f"activation shape {list(hidden.shape)} does not match [1, seq >= 1, {size}]")
        with self.lock:
            session = self.sessions.acquire(session_id, slot.key, position)
            out = self._run(session_id, slot, lambda: slot.shard.forward(hidden, session.cache, position, layers))
            self.batch_sizes.append((time.monotonic(), hidden.shape[0]))
            self.sessions.commit(session, hidden.shape[1])
            self.tokens_processed += hidden.shape[1]
        return out

    def _run(self, session_id: str, slot: ShardSlot, compute):
        """Run ``compute``; on an unexpected error drop the (possibly half-updated) session."""
        try:
            return compute()
        except MeshnetError:
            raise
        except Exception as exc:
            self.sessions.release(session_id)
            log.exception("forward failed on %s", slot.key)
            raise MeshnetError(f"forward failed on {slot.key}: {type(exc).__name__}: {exc}",
                               code="forward_failed", hint="the session was dropped; replay it from position 0") from exc

    def run_entry(self, slot: ShardSlot, session_id: str, input_ids: torch.Tensor, position: int,
                  layers: LayerRange) -> torch.Tensor:
        """Embed ``input_ids`` ``[1, seq]`` and run this node's entry ``layers``."""
        with self.lock:
            session = self.sessions.acquire(session_id, slot.key, position)
            out = self._run(session_id, slot, lambda: slot.shard.forward(
                slot.shard.embed_tokens(input_ids, position), session.cache, position, layers))
            self.batch_sizes.append((time.monotonic(), input_ids.shape[0]))
            self.sessions.commit(session, input_ids.shape[1])
            self.tokens_processed += input_ids.shape[1]
        return out

    def end_session(self, session_id: str) -> int:
        """End ``session_id`` on this node (:meth:`SessionStore.end`) once no forward runs
        (blocking: waits for the compute lock); returns how many caches were dropped."""
        with self.lock:
            return self.sessions.end(session_id)

    def check_room(self) -> None:
        """Whether a new session may start here now (blocking: waits for a running forward).

        Raises:
            SessionCacheFull: the session cache is at its cap (HTTP 503).
        """
        with self.lock:
            self.sessions.check_room()

    def describe(self) -> list[ShardInfo]:
        return [slot.describe() for slot in self.slots.values()]
