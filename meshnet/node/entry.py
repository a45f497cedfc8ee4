"""The entry node's own layers behind the gateway's interface (:class:`meshnet.gateway.entry.EntryLayers`).

:class:`LocalEntry` runs embeddings and the entry shard's layers in the node's runtime, the
LM head and the token choice (:mod:`meshnet.node.sampling`); every forward runs in the runtime's
batcher thread, so the event loop stays free (ADR-0049). :class:`WireCodec` turns activations into wire frames (ADR-0001).
"""

from __future__ import annotations

import time

import torch

from meshnet import wire
from meshnet.gateway.entry import Activation, TokenLogprob
from meshnet.layers import LayerRange
from meshnet.node.runtime import NodeRuntime, ShardSlot
from meshnet.node.sampling import TokenPicker
from meshnet.protocol.openai import SamplingParams


class WireCodec:
    """Activations ``[1, seq, hidden]`` to and from frames of ``wire_dtype`` (``bfloat16`` or ``float32``)."""

    def __init__(self, wire_dtype: str = "bfloat16") -> None:
        self.wire_dtype = wire_dtype

    async def encode(self, hidden: torch.Tensor) -> bytes:
        return await wire.encode_async(hidden, dtype=self.wire_dtype)

    async def decode(self, frame: bytes) -> torch.Tensor:
        """Raises: meshnet.errors.WireError (a malformed frame)."""
        return await wire.decode_async(frame)

    def shape(self, hidden: torch.Tensor) -> tuple[int, ...]:
        return tuple(hidden.shape)

    def last(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, -1:]

    def concat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def split(self, hidden: torch.Tensor, tokens: int) -> list[torch.Tensor]:
        return list(torch.split(hidden, tokens, dim=1))


class LocalEntry:
    """The entry shard in ``slot`` of ``runtime``, as the orchestrator drives it.

    Args:
        runtime: the node's runtime (sessions, lock); ``slot``: a shard holding layer 0, the
            embeddings, the final norm, the LM head and the tokenizer.
        wire_dtype: dtype of the frames sent to remote hops.
        metrics: the node's metrics (forward calls observed) or None.
    """

    def __init__(self, runtime: NodeRuntime, slot: ShardSlot, *, wire_dtype: str = "bfloat16", metrics=None) -> None:
        self.runtime, self.slot, self.metrics = runtime, slot, metrics
        shard = slot.shard
        self.model = slot.model
        self.num_layers = shard.num_layers
        self.local_end = slot.layers.end
        self.local_layers = LayerRange(0, self.local_end)
        self.tokenizer = shard.tokenizer
        self.vocab_size = int(shard.config.vocab_size)
        self.context_tokens = int(getattr(shard.config, "max_position_embeddings", 0) or 0)
        eos = shard.config.eos_token_id
        gen_eos = getattr(getattr(shard, "generation_config", None), "eos_token_id", None)
        ids = {self.tokenizer.eos_token_id}
        for value in (eos, gen_eos):
            ids.update(value if isinstance(value, (list, tuple)) else [value])
        self.eos_ids = frozenset(i for i in ids if i is not None)
        self.codec = WireCodec(wire_dtype)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    async def run(self, session_id: str, ids: list[int], position: int) -> torch.Tensor:
        """Hidden states ``[1, len(ids), hidden]`` (compute dtype) after the local layers."""
        tensor = torch.tensor([ids], dtype=torch.long)
        layers = self.local_layers
        t0 = time.perf_counter()
        out = await self.runtime.run_entry_async(self.slot, session_id, tensor, position, layers)
        if self.metrics is not None:
            self.metrics.record((len(ids), time.perf_counter() - t0, position, time.time(), time.monotonic()))
        return out

    def new_chooser(self, params: SamplingParams) -> TokenPicker:
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        return TokenPicker(self.vocab_size, params, generator)

    async def choose(self, hidden: Activation, chooser: TokenPicker, session_id: str) -> tuple[int, TokenLogprob | None]:
        """LM head on the last position (batched with other sessions' head steps, ADR-0041) and
        the token choice (per session). The head steps are the session's own in the batcher, so
        :meth:`release` ends the wait for them as for its layer steps."""
        logits = await self.runtime.logits_async(self.slot, session_id, hidden[:, -1:])
        return chooser.pick(logits[0, -1])

    def release(self, session_id: str) -> None:
        """End the session's local KV cache for good (:meth:`NodeRuntime.end_session_soon`): a step
        of it still queued in the batcher (a generation cancelled while its prefill chunk waited)
        is refused when it runs instead of creating the session again; returns at once."""
        self.runtime.end_session_soon(session_id)
