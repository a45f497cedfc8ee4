"""Admission references computed from a model's own files, not from whoever joined first (ADR-0070).

The tracker challenges a new shard with hidden states it drew at random (ADR-0042). Comparing the
answer with another holder's makes the first holder of a range, or a range no single holder
covers, unverifiable, and lets a forger who got there first set the bar. Where the tracker's host
can read the model's files, :class:`SourceReferences` computes the reference itself: the range's
decoder layers are loaded **one at a time** from those files in the candidate's recipe (its
quantization and compute dtype, as a node would load them), the challenge runs through each in
turn, and the layer is dropped before the next is read, so the memory held is one layer's,
whatever the range. The tracker holds this object through
:class:`meshnet.tracker.admission.ReferenceSource` (the tracker never imports model code); the
command line builds it (``meshnet tracker start --source-references``).

Cost, SmolLM2-135M on this 2-core host: see ADR-0070 (``bench/references.py``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from meshnet.layers import LayerRange
from meshnet.presets import canonical_model_name, find_preset

__all__ = ["MODES", "SourceReferences"]

log = logging.getLogger(__name__)

#: ``--source-references`` values: ``auto`` reads the files this host already holds and fetches
#: nothing; ``fetch`` fetches a range's files as a node would (a hub source only the range's);
#: ``off`` never computes a reference (holders are the references, as before ADR-0070)
MODES = ("auto", "fetch", "off")


class SourceReferences:
    """Challenge references from the model files of the models this host may read.

    Args:
        models: the tracker's own models (names as given to it); presets are readable too. A model
            a node names that is neither is never looked up (a node does not choose the paths the
            tracker reads).
        mode: ``auto`` or ``fetch`` (see :data:`MODES`).

    Thread use: :meth:`run` computes one reference at a time, in a worker thread, so references
    never hold more than one layer and never block the tracker's event loop.
    """

    def __init__(self, models: tuple[str, ...] = (), mode: str = "auto") -> None:
        if mode not in ("auto", "fetch"):
            raise ValueError(f"source references mode {mode!r}: expected auto or fetch")
        self.mode = mode
        self.models = {canonical_model_name(m) for m in models} | set(models)
        self._lock = asyncio.Lock()
        self.computed = 0  #: references computed (each one a challenge's whole range)

    def _readable(self, model: str) -> bool:
        return find_preset(model) is not None or model in self.models or canonical_model_name(model) in self.models

    def holds(self, model: str) -> bool:
        """Whether a reference of ``model`` can be computed here: a model this tracker may read,
        whose files this host holds (``auto``) or may fetch (``fetch``)."""
        if not self._readable(model):
            return False
        if self.mode == "fetch":
            return True
        from meshnet.models.sources import held_locally

        return held_locally(model) is not None

    def _path(self, model: str, layers: LayerRange, entry: bool = False) -> Path:
        """The model's directory: held here, or (``fetch``) fetched with ``layers`` (and the
        embeddings with ``entry``)."""
        from meshnet.models.sources import held_locally, resolve

        if self.mode == "fetch":  # a hub source fetches the files of those layers it lacks (a node's own way)
            return resolve(model, layers=layers, entry=entry)
        path = held_locally(model)
        if path is None:
            from meshnet.errors import ModelSourceError

            raise ModelSourceError(f"this host holds no files of {model}")
        return path

    async def run(self, model: str, layers: LayerRange, quantization: str, compute_dtype: str,
                  frame: bytes) -> bytes:
        """The float32 output frame ``[1, tokens, hidden]`` of ``layers`` of ``model``, in the recipe
        ``quantization``/``compute_dtype``, on the challenge ``frame`` (hidden states
        ``[1, tokens, hidden]`` at position 0): :meth:`compute` in a worker thread, one at a time.

        Raises:
            ModelSourceError: the files are not held (or could not be fetched) or lack the layers'
                tensors; KeyError: an unknown dtype; WireError: ``frame`` is not a frame.
        """
        out = await self._one_at_a_time(self.compute, model, layers, quantization, compute_dtype, frame)
        self.computed += 1
        return out

    async def _one_at_a_time(self, work, *args):
        """``work(*args)`` in a worker thread, after any other of this object's (one layer held at a time)."""
        async with self._lock:
            return await asyncio.to_thread(work, *args)

    async def challenge_input(self, model: str, start: int, tokens: int, seed: int) -> bytes:
        """A challenge's input as a real prefill of layers from ``start`` would carry it: :meth:`prefix`
        in a worker thread, one at a time.

        Raises:
            ModelSourceError: as :meth:`run`.
        """
        return await self._one_at_a_time(self.prefix, model, start, tokens, seed)

    def prefix(self, model: str, start: int, tokens: int, seed: int) -> bytes:
        """The bfloat16 frame ``[1, tokens, hidden]`` that layers ``0..start-1`` of ``model`` (bfloat16,
        from its files, one layer at a time) make of ``tokens`` token ids drawn from ``seed`` over the
        vocabulary: hidden states with a real prompt's statistics, in the wire dtype entries send
        (ADR-0070), not the standard-normal values a node could tell from traffic (the trust issue)."""
        from meshnet.models.shard import ShardModel
        from meshnet.node import wire

        import torch

        path = self._path(model, LayerRange(0, max(start, 1)), entry=True)
        head = ShardModel(path, LayerRange(0, 1), dtype="bfloat16", load_head=True)
        ids = torch.randint(int(head.config.vocab_size), (1, tokens), generator=torch.Generator().manual_seed(seed))
        hidden = head.embed_tokens(ids, 0)
        del head
        if start:
            hidden = _layer_by_layer(path, LayerRange(0, start), "bfloat16", "bfloat16", hidden)
        return wire.encode(hidden, dtype=torch.bfloat16)

    def compute(self, model: str, layers: LayerRange, quantization: str, compute_dtype: str, frame: bytes) -> bytes:
        """:meth:`run`'s work, on the calling thread: each decoder layer of ``layers`` loaded alone
        (:class:`meshnet.models.shard.ShardModel` of one layer, no embeddings or head), run on the
        previous layer's output with an empty KV cache at position 0, then dropped."""
        from meshnet.node import wire

        import torch

        path = self._path(model, layers)
        hidden = _layer_by_layer(path, layers, quantization, compute_dtype, wire.decode(frame))
        log.info("reference of %s layers %s (%s/%s) computed from %s", model, layers, quantization, compute_dtype,
                 path)
        return wire.encode(hidden, dtype=torch.float32)


def _layer_by_layer(path: Path, layers: LayerRange, quantization: str, compute_dtype: str, hidden):
    """``hidden`` ``[1, tokens, hidden]`` through decoder ``layers`` of the model at ``path``, each layer
    loaded alone in the recipe (a one-layer :class:`meshnet.models.shard.ShardModel`, no embeddings
    or head), run with an empty KV cache at position 0 and dropped before the next is read."""
    from meshnet.models.caches import KVCache
    from meshnet.models.shard import ShardModel

    for index in range(layers.start, layers.end):
        layer = ShardModel(path, LayerRange(index, index + 1), dtype=compute_dtype, load_head=False,
                           quantization=quantization)
        hidden = layer.forward(hidden, KVCache(), 0)
        del layer
    return hidden
