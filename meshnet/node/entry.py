"""The entry node's own stage behind the gateway's interface (:class:`meshnet.gateway.entry.EntryLayers`),
and the orchestrator a node builds around it for a chat (:func:`orchestrator_for`).

:class:`LocalEntry` runs embeddings and the entry shard's layers in the node's runtime, then the
LM head and the token choice; every forward runs in the runtime's batcher thread, so the event
loop stays free (ADR-0049). :class:`WireCodec` turns activations into wire frames (ADR-0001).

The token choice is here too: logit adjustments (penalties, bias), greedy/temperature/top-p
sampling and log-probabilities, pure functions over tensors plus one small stateful
:class:`TokenPicker`.
"""

from __future__ import annotations

import json
import logging
import time
import weakref

import torch

from meshnet.node import wire
from meshnet.dataplane.chain import ChainEnd
from meshnet.dataplane.failover import MeshLink
from meshnet.errors import InvalidRequest, MeshnetError, NotFound
from meshnet.gateway.pipeline import Orchestrator, OrchestratorSettings
from meshnet.gateway.speculation import StepCosts, parse_speculate
from meshnet.gateway.audit import Auditor
from meshnet.gateway.spotcheck import SpotChecker
from meshnet.gateway.entry import Activation, TokenLogprob
from meshnet.layers import LayerRange
from meshnet.models.families import LINEAR, layer_kinds
from meshnet.node.runtime import NodeRuntime
from meshnet.node.slots import ShardSlot
from meshnet.node.callers import advertised_endpoint
from meshnet.presets import canonical_model_name
from meshnet.protocol.control import AuditReport
from meshnet.protocol.openai import SamplingParams
from meshnet.protocol.route import Route as MeshRoute

log = logging.getLogger(__name__)


def sample_token(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """Pick the next token id from ``logits`` ``[vocab]`` (float32).

    ``temperature <= 0`` is greedy (argmax, ties to the lowest id as ``torch.argmax``).
    Otherwise softmax(logits / temperature), restricted to the smallest set of tokens whose
    probability mass reaches ``top_p`` (Holtzman et al. 2019, "The Curious Case of Neural
    Text Degeneration"), sampled with ``generator`` (seeded per request for reproducibility).
    """
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        keep = cumulative - sorted_probs < top_p
        keep[0] = True
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = sorted_probs[keep]
        probs = filtered / filtered.sum()
    return int(torch.multinomial(probs, 1, generator=generator))


def adjust_logits(logits: torch.Tensor, counts: torch.Tensor | None, *, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Logits after OpenAI's penalties and logit bias (a new float32 tensor ``[vocab]``).

    As the OpenAI API reference documents them ("frequency and presence penalties"):
    ``logit[j] - counts[j] * frequency_penalty - (counts[j] > 0) * presence_penalty``, where
    ``counts[j]`` (float32 ``[vocab]``) is how often token ``j`` was generated so far in this
    choice (prompt tokens do not count; None when neither penalty is set); then ``bias`` (float32 ``[vocab]``, the request's
    ``logit_bias`` scattered over the vocabulary, zeros elsewhere) is added.
    """
    out = logits.float().clone()
    if frequency_penalty:
        out -= counts * frequency_penalty
    if presence_penalty:
        out -= (counts > 0).float() * presence_penalty
    if bias is not None:
        out += bias
    return out


def token_logprob(logits: torch.Tensor, token_id: int, top: int = 0) -> TokenLogprob:
    """``log_softmax(logits)`` at ``token_id`` and the ``top`` (0..20) best tokens' values.

    ``logits`` ``[vocab]`` are the adjusted logits (:func:`adjust_logits`), before temperature
    and top-p: the model's distribution as the request's penalties and bias shape it, so the
    values do not depend on the sampling temperature and exist for greedy decoding too.
    """
    logp = torch.log_softmax(logits.double(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        # stable sort: ties keep the lowest id first (topk's tie order is unspecified)
        values, ids = torch.sort(logp, descending=True, stable=True)
        best = tuple((int(i), float(v)) for i, v in zip(ids[:top], values[:top]))
    return TokenLogprob(token_id, float(logp[token_id]), best)


_GRAMMAR_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF tokenizer -> llguidance's


class GrammarMask:
    """One choice's output grammar (ADR-0053): before each token, the logits of tokens the grammar
    does not allow next are set to -inf (llguidance's token mask over the tokenizer's vocabulary;
    ids past it, a padded LM head's, are never allowed); the chosen token then advances it. Once
    the grammar is complete only the end token is allowed, so the generation ends there.

    Raises:
        InvalidRequest: the schema does not compile into a grammar.
    """

    def __init__(self, tokenizer, json_schema: str) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        lltok = _GRAMMAR_TOKENIZERS.get(tokenizer)
        if lltok is None:
            lltok = _GRAMMAR_TOKENIZERS[tokenizer] = llguidance.hf.from_tokenizer(tokenizer)
        # compact JSON (one space after ':' and ','): free whitespace would let a model spend its
        # tokens on blanks before the closing brace
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(json_schema),
                                                               overrides={"whitespace_flexible": False})
        self.matcher = llguidance.LLMatcher(lltok, grammar)
        if self.matcher.is_error():
            raise InvalidRequest(f"invalid field 'response_format': {self.matcher.get_error()}",
                                 code="invalid_field", param="response_format")
        self.vocab = lltok.vocab_size
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab)  # one per choice, refilled each token

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[vocab]`` float32 with the disallowed tokens at -inf (a new tensor)."""
        import llguidance.torch

        bitmask = self.bitmask
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        allowed = logits.new_full(logits.shape, float("-inf"))
        head = logits[:self.vocab].unsqueeze(0).clone()
        llguidance.torch.apply_token_bitmask_inplace(head, bitmask)
        allowed[:self.vocab] = head[0]
        return allowed

    def consume(self, token: int) -> None:
        """Advance past the chosen ``token`` (one the mask allowed)."""
        self.matcher.consume_token(token)


class TokenPicker:
    """Chooses one choice's tokens step by step: adjusts the logits by the penalties (counting
    the tokens it picked) and ``logit_bias``, samples, and records log-probabilities when the
    request asked for them (``params.top_logprobs`` not None).

    Args:
        vocab_size: length of the logits it will be given.
        params: the choice's settings; ``logit_bias`` ids must be below ``vocab_size``.
        generator: seeded generator of the choice (None: torch's global one).
        grammar: the choice's output grammar (``params.json_schema``, :class:`GrammarMask`), or None.
    Raises:
        ValueError: a ``logit_bias`` id outside the vocabulary.
    """

    def __init__(self, vocab_size: int, params: SamplingParams, generator: torch.Generator | None = None,
                 grammar: GrammarMask | None = None) -> None:
        self.params, self.generator, self.grammar = params, generator, grammar
        # generated-token counts: read only by the penalties, so kept only when one is asked for
        self.counts = (torch.zeros(vocab_size, dtype=torch.float32)
                       if params.frequency_penalty or params.presence_penalty else None)
        self.bias = None
        if params.logit_bias:
            ids = [i for i, _ in params.logit_bias]
            if max(ids) >= vocab_size:
                raise ValueError(f"token id {max(ids)} is outside the vocabulary (0..{vocab_size - 1})")
            self.bias = torch.zeros(vocab_size, dtype=torch.float32)
            self.bias[ids] = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        self._adjusts = bool(params.frequency_penalty or params.presence_penalty or self.bias is not None)

    def pick(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """Next token id from ``logits`` ``[vocab]`` and its :class:`TokenLogprob` (or None)."""
        p = self.params
        if self._adjusts:
            logits = adjust_logits(logits, self.counts, frequency_penalty=p.frequency_penalty,
                                   presence_penalty=p.presence_penalty, bias=self.bias)
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        token = sample_token(logits, temperature=p.temperature, top_p=p.top_p, generator=self.generator)
        if self.grammar is not None:
            self.grammar.consume(token)
        if self.counts is not None:
            self.counts[token] += 1
        logprob = None if p.top_logprobs is None else token_logprob(logits, token, p.top_logprobs)
        return token, logprob


def chat_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """See :meth:`LocalEntry.encode_chat`: the prompt is rendered once; where a message holds one of
    the tokenizer's added tokens (``get_added_vocab``: ``<|im_end|>`` and its kin), the template's
    text between messages is tokenized with its control tokens and each message's text with them
    split into plain text (``split_special_tokens``)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    controls = tuple(tokenizer.get_added_vocab())
    contents = [m.get("content") or "" for m in messages]
    if not any(c in content for content in contents for c in controls):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids, cursor = [], 0
    for i, content in enumerate(contents):
        at = text.find(content, cursor)
        if at < 0 and content.strip():  # templates that trim a message
            content = content.strip()
            at = text.find(content, cursor)
        if at < 0:
            raise InvalidRequest(f"message {i}: its text could not be kept apart from the chat template",
                                 code="invalid_field", param=f"messages.{i}.content")
        ids += tokenizer(text[cursor:at], add_special_tokens=False)["input_ids"]
        ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        cursor = at + len(content)
    return ids + list(tokenizer(text[cursor:], add_special_tokens=False)["input_ids"])


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

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, generation prompt added.

        The template's own control tokens are real; the same strings typed inside a message are
        text: a user who writes ``<|im_end|>`` cannot close their turn and forge a system turn.
        A message that holds no control string is tokenized exactly as transformers'
        ``apply_chat_template`` does.

        Raises:
            InvalidRequest: the template changed a message so that its text cannot be found in the
                prompt (then its control strings could not be kept as text).
        """
        return chat_token_ids(self.tokenizer, messages, tools)

    async def run(self, session_id: str, ids: list[int], position: int, rewind: bool = False) -> torch.Tensor:
        """Hidden states ``[1, len(ids), hidden]`` (compute dtype) after the local layers (``rewind``:
        a speculative step, the cache may first go back to ``position``, ADR-0058)."""
        tensor = torch.tensor([ids], dtype=torch.long)
        layers = self.local_layers
        t0 = time.perf_counter()
        out = await self.runtime.run_entry_async(self.slot, session_id, tensor, position, layers, rewind)
        if self.metrics is not None:
            self.metrics.record((len(ids), time.perf_counter() - t0, position, time.time(), time.monotonic()))
        return out

    def new_chooser(self, params: SamplingParams) -> TokenPicker:
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        grammar = None if params.json_schema is None else GrammarMask(self.tokenizer, params.json_schema)
        return TokenPicker(self.vocab_size, params, generator, grammar)

    async def choose(self, hidden: Activation, chooser: TokenPicker, session_id: str) -> tuple[int, TokenLogprob | None]:
        """LM head on the last position (batched with other sessions' head steps, ADR-0052) and
        the token choice (per session). The head steps are the session's own in the batcher, so
        :meth:`release` ends the wait for them as for its layer steps."""
        logits = await self.runtime.logits_async(self.slot, session_id, hidden[:, -1:])
        return chooser.pick(logits[0, -1])

    def can_rewind(self) -> bool:
        """Whether no layer of the model keeps a linear-attention (recurrent) state, which a cache
        rewind cannot take back (:meth:`KVCache.rewind`)."""
        return LINEAR not in layer_kinds(self.slot.shard.config)

    async def verify(self, hidden: Activation, chooser: TokenPicker, session_id: str, drafts: list[int],
                     limit: int) -> list[tuple[int, TokenLogprob | None]]:
        """See :meth:`meshnet.gateway.entry.EntryLayers.verify`: the LM head over every position of
        ``hidden`` ``[1, len(drafts) + 1, hidden]`` in one head step, then the picks in order."""
        logits = await self.runtime.logits_async(self.slot, session_id, hidden)
        picks = []
        for i in range(len(drafts) + 1):
            token, logprob = chooser.pick(logits[i, -1])
            picks.append((token, logprob))
            if len(picks) >= limit or token in self.eos_ids or i == len(drafts) or token != drafts[i]:
                break
        return picks

    async def score(self, hidden: Activation, targets: list[int], top: int, session_id: str) -> list[TokenLogprob]:
        """Log-probabilities of ``targets`` given the positions of ``hidden`` ``[1, n, hidden]``
        (position i predicts ``targets[i]``; ``len(targets) <= n``), each with the ``top`` (0..5)
        most likely tokens: the LM head over every position in one head step, then a float32
        ``log_softmax`` per position (:func:`token_logprob`). No penalty or bias applies: this is
        the model's own distribution, as a prompt's scores are."""
        logits = await self.runtime.logits_async(self.slot, session_id, hidden[:, :len(targets)])
        return [token_logprob(logits[i, -1], t, top) for i, t in enumerate(targets)]

    def release(self, session_id: str) -> None:
        """End the session's local KV cache for good (:meth:`NodeRuntime.end_session_soon`): a step
        of it still queued in the batcher (a generation cancelled while its prefill chunk waited)
        is refused when it runs instead of creating the session again; returns at once."""
        self.runtime.end_session_soon(session_id)


def orchestrator_for(node, model: str | None, pipelined: bool | None = None) -> tuple[str, Orchestrator]:
    """The entry orchestrator of ``model`` (any of its names; the only entry shard when None) on
    ``node`` (the node app's ``NodeContext``: its runtime, settings, agent, streams, metrics).

    Raises:
        NotFound: this node holds no entry shard of that model.
    """
    wanted = None if model is None else canonical_model_name(model)
    entries = [s for s in node.runtime.slots.values() if s.shard.is_entry]
    slot = next((s for s in entries if wanted in (None, s.model)), None)
    if slot is None:
        raise NotFound(f"this node serves no entry shard of {model or 'any model'}", code="model_not_found",
                       param="model", hint="GET /v1/models lists the models this node answers for")
    agent = node.agent

    async def routes(name, layers, exclude, session_id) -> MeshRoute:
        if agent is None:
            raise NotFound("standalone node without a tracker cannot route remote layers")
        return await agent.session_route(name, layers, exclude, session_id)

    async def report(node_id, reason, ticket):
        if agent is not None:
            await agent.report_failure(node_id, reason, ticket)

    if node.spot_checker is None and agent is not None:
        node.spot_checker = spot_checker_for(node)
    if node.auditor is None and agent is not None:
        node.auditor = auditor_for(node)
        node.metrics.audit_stats = node.auditor.stats
    settings = OrchestratorSettings(hop_timeout_s=node.settings.hop_timeout_s,
                                    hop_connect_timeout_s=node.settings.hop_connect_timeout_s,
                                    pipelined=True if pipelined is None else pipelined,
                                    chain=node.settings.hop_streams,
                                    speculate=parse_speculate(node.settings.speculate))
    entry = LocalEntry(node.runtime, slot, wire_dtype=node.settings.wire_dtype, metrics=node.metrics)
    advertised = advertised_endpoint(node)  # relayed: the relay's URL (ADR-0045)
    end = ChainEnd(node.settings.node_id, advertised, node.streams, node.inbox)
    link = MeshLink(node.http, routes, report, None if agent is None else agent.signer)
    costs = node.step_costs.setdefault(slot.model, StepCosts())  # learnt across this entry's sessions
    return slot.model, Orchestrator(entry, end=end, link=link, settings=settings, observer=node.metrics,
                                    traffic=node.traffic, spot_check=node.spot_checker, step_costs=costs,
                                    audit=node.auditor)


def auditor_for(node) -> Auditor:
    """This entry's auditor (``audit_rate`` of its sessions, more while a hop is on probation):
    witnesses of the audited hop's recipe from the tracker, receipts checked with the keys the
    tracker binds to node ids, disputes sent to it (ADR-0067)."""
    agent = node.agent

    async def routes(name, layers, exclude, session_id, like) -> MeshRoute:
        return await agent.session_route(name, layers, exclude, session_id, like)

    async def report(node_id: str, evidence: AuditReport) -> dict:
        return await agent.report_audit(node_id, evidence)

    return Auditor(node.settings.audit_rate, client=node.http, routes=routes, report=report,
                   timeout_s=node.settings.hop_timeout_s, release_auth=agent.signer, keys=agent.client.node_key)


def spot_checker_for(node) -> SpotChecker:
    """This entry's spot-checker (``spot_check_rate`` of its sessions): witnesses of the checked
    hop's recipe from the tracker (ADR-0042); an outvoted node's own signed step goes to the
    tracker, which re-runs it and decides (ADR-0067)."""
    agent = node.agent

    async def routes(name, layers, exclude, session_id, like) -> MeshRoute:
        return await agent.session_route(name, layers, exclude, session_id, like)

    async def report(node_id: str, model: str, hop, witnesses: list[str], distances: dict[str, float],
                     limit: float, session: str, ticket: str | None, evidence: AuditReport | None) -> None:
        if evidence is None:
            log.warning("spot-check: %s was outvoted over layers %s but signed nothing to show the tracker",
                        node_id, hop.layers)
            return
        try:
            verdict = await agent.report_audit(node_id, evidence)
        except MeshnetError as exc:
            log.warning("could not report %s's spot-check to the tracker: %s", node_id, exc.message)
            return
        log.warning("tracker's verdict on %s's spot-check: %s", node_id, verdict)

    return SpotChecker(node.settings.spot_check_rate, client=node.http, routes=routes, report=report,
                       timeout_s=node.settings.hop_timeout_s, release_auth=None if agent is None else agent.signer)
