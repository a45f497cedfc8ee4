"""The orchestrator: drives one generation from the entry node across its route.

Prefill runs the prompt in chunks of ``chunk_tokens`` (128): embed → the entry node's own
layers → each remote hop → final norm + LM head on the last position → sample. With
``pipelined`` prefill, chunk i enters hop k while chunk i+1 runs on the layers before it
(ordering per hop is kept by the KV-cache position, see :mod:`meshnet.gateway.hops`).
Decode then sends one token's hidden state per hop per step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from meshnet.gateway.hops import FailureReporter, Hop, RemoteRoute, RouteProvider
from meshnet.gateway.sampling import TokenLogprob, TokenPicker
from meshnet.protocol.openai import SamplingParams
from meshnet.layers import LayerRange
from meshnet.node.runtime import NodeRuntime, ShardSlot

log = logging.getLogger(__name__)

#: prefill chunk length in tokens (DESIGN.md, "The request path")
CHUNK_TOKENS = 128


@dataclass
class GenerationStats:
    """What a finished (or running) generation measured."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    route: list[Hop] = field(default_factory=list)
    failovers: int = 0
    finish_reason: str = "length"
    token_ids: list[int] = field(default_factory=list)
    #: one entry per generated token when the request asked for logprobs (else empty)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the decode time (tokens/s)."""
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class OrchestratorSettings:
    wire_dtype: str = "bfloat16"
    chunk_tokens: int = CHUNK_TOKENS
    hop_timeout_s: float = 60.0
    hop_connect_timeout_s: float = 5.0
    pipelined: bool = True


class Orchestrator:
    """Runs generations whose entry layers are in ``slot`` of ``runtime``.

    Args:
        runtime: this node's runtime; ``slot``: its entry shard (holds embeddings and head).
        node_id, endpoint: this node, shown as the first hop of every route.
        client: httpx client for hops; ``routes``/``report``: tracker callbacks.
    """

    def __init__(self, runtime: NodeRuntime, slot: ShardSlot, *, node_id: str, endpoint: str, client,
                 routes: RouteProvider, report: FailureReporter,
                 settings: OrchestratorSettings = OrchestratorSettings(), metrics=None) -> None:
        self.runtime, self.slot = runtime, slot
        self.node_id, self.endpoint = node_id, endpoint
        self.client, self.routes, self.report = client, routes, report
        self.settings = settings
        self.metrics = metrics  # NodeMetrics or None: generation_started / generation_finished
        shard = slot.shard
        self.num_layers = shard.num_layers
        self.tokenizer = shard.tokenizer
        eos = shard.config.eos_token_id
        gen_eos = getattr(getattr(shard, "generation_config", None), "eos_token_id", None)
        ids = {self.tokenizer.eos_token_id}
        for value in (eos, gen_eos):
            ids.update(value if isinstance(value, (list, tuple)) else [value])
        self.eos_ids = {i for i in ids if i is not None}
        self.vocab_size = int(shard.config.vocab_size)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` under the model's chat template (generation prompt added)."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    async def _entry(self, session_id: str, ids: list[int], position: int) -> torch.Tensor:
        tensor = torch.tensor([ids], dtype=torch.long)
        layers = LayerRange(0, self.slot.layers.end)
        t0 = time.perf_counter()
        out = await asyncio.to_thread(self.runtime.run_entry, self.slot, session_id, tensor, position, layers)
        if self.metrics is not None:
            self.metrics.observe_forward(len(ids), time.perf_counter() - t0, position)
        return out

    async def _pick(self, hidden: torch.Tensor, picker: TokenPicker) -> tuple[int, TokenLogprob | None]:
        """LM head on the last position and the token choice, in one worker-thread call."""
        def run():
            return picker.pick(self.slot.shard.logits(hidden[:, -1:])[0, -1])
        return await asyncio.to_thread(run)

    async def _step(self, session_id: str, remote: RemoteRoute | None, ids: list[int], position: int,
                    local_turn: asyncio.Condition, local_len: list[int]) -> torch.Tensor:
        async with local_turn:
            await local_turn.wait_for(lambda: local_len[0] == position)
        hidden = await self._entry(session_id, ids, position)
        async with local_turn:
            local_len[0] = position + len(ids)
            local_turn.notify_all()
        if remote is not None:
            hidden = await remote.forward(hidden, position, last_only=True)
        return hidden[:, -1:]

    async def _prefill(self, session_id: str, remote: RemoteRoute | None, prompt: list[int],
                       local_turn: asyncio.Condition, local_len: list[int]) -> torch.Tensor:
        size = self.settings.chunk_tokens
        chunks = [(p, prompt[p:p + size]) for p in range(0, len(prompt), size)]
        if self.settings.pipelined:
            try:  # a failed chunk cancels its siblings (left running, they would wait on it forever)
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self._step(session_id, remote, c, p, local_turn, local_len))
                             for p, c in chunks]
            except BaseExceptionGroup as group_exc:
                raise group_exc.exceptions[0] from None
            return tasks[-1].result()
        hidden = None
        for p, c in chunks:
            hidden = await self._step(session_id, remote, c, p, local_turn, local_len)
        return hidden

    async def generate(self, prompt: list[int], params: SamplingParams,
                       stats: GenerationStats | None = None) -> AsyncIterator[int]:
        """Yield generated token ids one by one (EOS excluded); fills ``stats`` as it goes.

        Raises:
            ModelNotRoutable: the tracker has no route for the remote layers.
            HopFailed: a hop failed and could not be replaced.
        """
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(prompt)
        session_id = uuid.uuid4().hex
        local_end = self.slot.layers.end
        entry_hop = Hop(self.node_id, self.endpoint, LayerRange(0, local_end))
        remote = None
        if local_end < self.num_layers:
            hops = await self.routes(self.slot.model, LayerRange(local_end, self.num_layers), frozenset())
            remote = RemoteRoute(self.client, model=self.slot.model, session_id=session_id, hops=hops,
                                 routes=self.routes, report=self.report, wire_dtype=self.settings.wire_dtype,
                                 timeout_s=self.settings.hop_timeout_s,
                                 connect_timeout_s=self.settings.hop_connect_timeout_s)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        picker = TokenPicker(self.vocab_size, params, generator)
        local_turn, local_len = asyncio.Condition(), [0]
        if self.metrics is not None:
            self.metrics.generation_started()
        try:
            t0 = time.perf_counter()
            hidden = await self._prefill(session_id, remote, prompt, local_turn, local_len)
            position = len(prompt)
            stats.prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            for _ in range(params.max_tokens):
                token, logprob = await self._pick(hidden, picker)
                if token in self.eos_ids:
                    stats.finish_reason = "stop"
                    break
                stats.completion_tokens += 1
                stats.token_ids.append(token)
                if logprob is not None:
                    stats.logprobs.append(logprob)
                yield token
                if stats.completion_tokens == params.max_tokens:
                    break
                if stats.completion_tokens == 1:
                    t1 = time.perf_counter()
                hidden = await self._step(session_id, remote, [token], position, local_turn, local_len)
                position += 1
            stats.decode_s = time.perf_counter() - t1
        finally:
            stats.route = [entry_hop] + (remote.hops if remote else [])
            stats.failovers = remote.failovers if remote else 0
            self.runtime.sessions.release(session_id)
            if self.metrics is not None:
                self.metrics.generation_finished(stats)
            if remote is not None:
                await remote.close()
