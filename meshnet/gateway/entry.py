"""What the orchestrator needs of the entry node's own layers: an interface, torch-free.

The gateway drives a generation (prefill chunks, decode steps, remote hops, failover) without
knowing how the entry node computes: activations are opaque values it passes between the
methods below, and frames are the bytes hops exchange. The node implements it
(:class:`meshnet.node.entry.LocalEntry`); tests may implement it with a fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from meshnet.dataplane.codec import Activation, ActivationCodec
from meshnet.protocol.ids import SessionId
from meshnet.protocol.openai import SamplingParams

@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's natural-log probability and the ``top`` most likely alternatives
    (``(token_id, logprob)``, most likely first, ties to the lowest id)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenChooser(Protocol):
    """The state of one choice's token choice (penalty counts, seeded generator)."""


class EntryLayers(Protocol):
    """The entry node's own layers ``[0, local_end)`` of ``model``, with embeddings, the final
    norm and LM head, and the tokenizer.

    Attributes:
        model: the model's canonical name; ``num_layers`` its decoder layers.
        local_end: layers ``[0, local_end)`` run here; the rest are remote hops.
        vocab_size: length of the logits; ``eos_ids``: tokens that end a generation.
        context_tokens: the model's context (``max_position_embeddings``), 0 when unknown.
        tokenizer: a transformers tokenizer (``decode``, ``convert_ids_to_tokens``, vocabulary).
        codec: activations to and from frames.
    """

    model: str
    num_layers: int
    local_end: int
    vocab_size: int
    eos_ids: frozenset[int]
    context_tokens: int
    tokenizer: Any
    codec: ActivationCodec

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` under the chat template, generation prompt added, ``tools``
        (OpenAI's shape) passed to a template that renders them (CPU-bound)."""

    async def run(self, session_id: SessionId, ids: list[int], position: int, rewind: bool = False) -> Activation:
        """Embed ``ids`` at ``position`` and run the local layers in the session's KV cache; with
        ``rewind`` (a speculative step) the cache first goes back to ``position``.

        Raises:
            meshnet.errors.MeshnetError: the session's cache is full or out of step.
        """

    def can_rewind(self) -> bool:
        """Whether a session's caches can go back a few positions (no layer of the model keeps a
        recurrent state): speculative decoding needs it."""

    def new_chooser(self, params: SamplingParams) -> TokenChooser:
        """A fresh token chooser for one choice (seeded by ``params.seed`` when given)."""

    async def choose(self, hidden: Activation, chooser: TokenChooser, session_id: SessionId) -> tuple[int, TokenLogprob | None]:
        """LM head on the last position of ``hidden`` and the next token (with its logprob when asked),
        for session ``session_id``."""

    async def verify(self, hidden: Activation, chooser: TokenChooser, session_id: SessionId, drafts: list[int],
                     limit: int) -> list[tuple[int, TokenLogprob | None]]:
        """The token choice at each position of a speculative step's ``hidden`` ``[1, len(drafts) + 1,
        ...]``, in order, as plain decoding would make it: ends at the first pick that differs from
        the draft fed at the next position, at an end token, after ``limit`` picks, or after the
        last position. Returns the picks (at least one)."""

    async def score(self, hidden: Activation, targets: list[int], top: int,
                    session_id: SessionId) -> list[TokenLogprob]:
        """Log-probability of each of ``targets`` given the matching position of ``hidden`` (all
        positions of a prefill chunk, after the last layer), with the ``top`` most likely tokens."""

    def release(self, session_id: SessionId) -> None:
        """Drop the session's local KV cache; nothing waits for its steps any more (its head steps
        included)."""


class GenerationObserver(Protocol):
    """Who counts generations (the node's metrics)."""

    def generation_started(self) -> None: ...

    def first_token(self, seconds: float) -> None:
        """Seconds from the request's arrival to its first token handed to the client."""

    def generation_finished(self, stats: Any) -> None: ...
