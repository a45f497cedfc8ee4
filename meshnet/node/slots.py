"""Shard slots: the shard backends one node has loaded, and how a load is measured.

A node holds up to ``max_loaded_shards`` slots; each slot is one :class:`ShardModel` (one
model, one layer range, one recipe). Loading and dropping are rare, slow events (seconds for
real weights); what runs on every step lives in :mod:`meshnet.node.runtime`.

Each load measures the shard's resident memory (ADR-0039): the process RSS after the shard is
built and has run one warm-up forward, minus the RSS just before, with transformers' modeling
code imported and run once beforehand so its fixed cost is not charged to the first shard. doctor reports
the figure and the tracker budgets with it where it exceeds the preset.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange
from meshnet.models.devices import is_gpu
from meshnet.models.caches import KVCache
from meshnet.models.shard import ShardModel, prepare_layouts, trim_heap, warm_runtime
from meshnet.node.hardware import rss_bytes
from meshnet.presets import canonical_model_name
from meshnet.protocol.control import CapabilityReport, ShardInfo

log = logging.getLogger(__name__)

WARM_UP_TOKENS = 16


def slot_key(model: str, layers: LayerRange) -> str:
    """The name of the slot holding ``layers`` of ``model`` (canonical name): ``model:start-end``."""
    return f"{model}:{layers.start}-{layers.end}"


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
    #: ``model:start-end``, the name sessions, batches and reports use (a field: read on every step)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = slot_key(self.model, self.layers)

    def describe(self, report: CapabilityReport | None = None) -> ShardInfo:
        """This slot as the node reports it to the tracker (with its latest capability report)."""
        start, end = self.layers.to_inclusive()
        return ShardInfo(model=self.model, shard_start=start, shard_end=end, tier=self.tier,
                         quantization=self.quantization, weight_bytes=self.shard.weight_bytes(),
                         entry=self.shard.is_entry, num_layers=self.shard.num_layers, report=report)


def measure_load(build, dtype: str, prepare=None, device: str = "cpu") -> tuple[ShardModel, int]:
    """Build a shard with ``build()`` and measure its resident memory, bytes.

    On a GPU (``device`` ``cuda:N``) the figure is the device memory torch allocated for it
    (weights and the warm-up forward's lasting buffers), never below its weights.

    The figure is the process RSS after the build, one ``WARM_UP_TOKENS``-token forward on a
    throwaway cache (the compute's lasting buffers) and :func:`trim_heap`, minus the RSS just
    before the build. The process's fixed costs are paid first (:func:`warm_runtime` in compute
    dtype ``dtype``: transformers' modeling code, the kernels' first run; then ``prepare()``
    when given, for the build's own fixed costs: :func:`prepare_layouts`). It is
    never below the shard's :meth:`ShardModel.weight_bytes` (page reuse can hide a small shard).
    Concurrent work in the process (another slot's sessions growing) adds to it: the figure errs
    high, the safe side for placement. Errors of ``build`` propagate.
    """
    gpu = torch.device(device) if is_gpu(device) else None
    if gpu is None:  # the CPU kernels' first run and timings (a GPU's cost nothing of the process's RSS)
        warm_runtime(dtype)
    if prepare is not None:
        prepare()
    trim_heap()
    before, gpu_before = rss_bytes(), 0 if gpu is None else torch.cuda.memory_allocated(gpu)
    shard = build()
    with torch.inference_mode():
        hidden = torch.zeros(1, WARM_UP_TOKENS, shard.config.hidden_size)
        shard.forward(hidden, KVCache(), 0)
    trim_heap()
    if gpu is not None:  # its weights are in the GPU's memory, not the process's
        return shard, max(torch.cuda.memory_allocated(gpu) - gpu_before, shard.weight_bytes())
    return shard, max(rss_bytes() - before, shard.weight_bytes())


class SlotHolder:
    """What a node does between generations, not on their steps: loading and dropping its slots,
    admitting and ending sessions. :class:`meshnet.node.runtime.NodeRuntime` is one.

    Attributes the runtime sets: ``slots`` (key -> :class:`ShardSlot`), ``max_loaded_shards``,
    ``compute_dtype``, ``device``, ``lock`` (the compute lock), ``sessions`` (the :class:`~meshnet.node.sessions.SessionStore`) and
    ``_found`` (the slot lookups, emptied when a slot comes or goes), ``batcher`` (its
    :class:`~meshnet.node.batching.StepBatcher`).
    """

    slots: dict[str, ShardSlot]
    max_loaded_shards: int
    compute_dtype: str
    device: str
    lock: threading.Lock
    _found: dict

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
        recipe = {"dtype": self.compute_dtype, "quantization": quantization}
        gpu = is_gpu(self.device)
        try:
            shard, resident = measure_load(lambda: ShardModel(model_path, layers, device=self.device, **recipe),
                                           self.compute_dtype,
                                           None if gpu else lambda: prepare_layouts(model_path, layers, **recipe),
                                           self.device)
        except torch.OutOfMemoryError as exc:  # nothing of the half-built shard stays on the device
            torch.cuda.empty_cache()
            raise MeshnetError(f"{model} layers {layers} do not fit in {self.device}'s free memory: "
                               f"{str(exc).splitlines()[0]}", code="device_memory", status=507,
                               hint="serve fewer layers, a smaller recipe (--quantization nf4), or --device cpu") \
                from None
        slot = ShardSlot(model=model, layers=layers, quantization=quantization, shard=shard, tier=tier,
                         resident_bytes=resident)
        with self.lock:
            self.slots[slot.key] = slot
            self._found.clear()
        log.info("loaded %s layers %s (%d bytes of weights, %d resident)", model, layers,
                 shard.weight_bytes(), resident)
        return slot

    def drop(self, model: str, layers: LayerRange) -> ShardSlot | None:
        """Free a slot's weights and its sessions; the slot dropped (its ``key`` names its reports),
        None when it was not loaded."""
        key = slot_key(canonical_model_name(model), layers)
        with self.lock:
            slot = self.slots.pop(key, None)
            self._found.clear()
            if slot is not None:
                self.sessions.release_slot(key)
        return slot

    def describe(self) -> list[ShardInfo]:
        return [slot.describe() for slot in self.slots.values()]

    def was_ended(self, session_id: str) -> bool:
        """Whether the entry ended ``session_id`` on this node (:meth:`~meshnet.node.sessions.SessionStore.was_ended`)."""
        return self.sessions.was_ended(session_id)

    def end_session(self, session_id: str) -> int:
        """End ``session_id`` on this node (:meth:`SessionStore.end`) once no forward runs
        (blocking: waits for the compute lock); returns how many caches were dropped."""
        self.batcher.forget(session_id)
        with self.lock:
            return self.sessions.end(session_id)

    def end_session_soon(self, session_id: str) -> None:
        """:meth:`end_session` without blocking the caller (an event loop, or a generation being
        cancelled): batches stop waiting for the session at once, and its caches are ended in a
        worker thread once the running forward is over. Its ``end`` tombstone refuses a step of it
        still queued, so nothing re-creates the session (ADR-0031). Never raises."""
        self.batcher.forget(session_id)
        self.sessions.mark_ended(session_id)  # at once: a queued step of it is refused, whoever runs first
        if self.lock.acquire(blocking=False):  # no forward runs: end it now, without a thread hop
            try:
                self.sessions.end(session_id)
            finally:
                self.lock.release()
            return
        try:
            asyncio.get_running_loop().run_in_executor(None, self.end_session, session_id)
        except RuntimeError:  # no running loop, or its executor is shut down: end it here
            self.end_session(session_id)

    def check_room(self) -> None:
        """Whether a new session may start here now (blocking: waits for a running forward).

        Raises:
            SessionCacheFull: the session cache is at its cap (HTTP 503).
        """
        with self.lock:
            self.sessions.check_room()
