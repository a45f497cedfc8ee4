"""The orchestrator: drives one generation from the entry node across its route.

Prefill runs the prompt in chunks of ``chunk_tokens`` (128): embed → the entry node's own
layers → each remote hop → final norm + LM head on the last position → sample. With
``pipelined`` prefill, chunk i enters hop k while chunk i+1 runs on the layers before it
(ordering per hop is kept by the KV-cache position, see :mod:`meshnet.dataplane.hops`).
Decode then sends one token's hidden state per hop per step.

The remote hops are driven as a chain of hop streams (:class:`meshnet.dataplane.chain.ChainRoute`,
ADR-0040: each hop pushes its output to the next, the last one back to the entry) when the node
gives the orchestrator its stream pool; otherwise, or with ``chain`` off, the entry calls each
hop in turn over HTTP (:class:`meshnet.dataplane.hops.RemoteRoute`, the fallback path).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from meshnet.dataplane.chain import ChainEnd, ChainRoute, StageOrder
from meshnet.dataplane.deadlines import DeadlinePolicy
from meshnet.gateway.entry import Activation, EntryLayers, GenerationObserver, TokenChooser, TokenLogprob
from meshnet.dataplane.hops import RemoteRoute
from meshnet.dataplane.failover import MeshLink, RemoteContext
from meshnet.gateway.traffic import TrafficLog
from meshnet.gateway.audit import Auditor
from meshnet.gateway.spotcheck import SpotChecker
from meshnet.gateway.speculation import PromptLookup, SpeculationPolicy, StepCosts
from meshnet.layers import LayerRange
from meshnet.protocol.openai import SamplingParams
from meshnet.protocol.route import Hop

log = logging.getLogger(__name__)

#: prefill chunk length in tokens (DESIGN.md, "The request path")
CHUNK_TOKENS = 128


@dataclass
class GenerationStats:
    """What a finished (or running) generation measured."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: perf_counter seconds when the request arrived (set by the OpenAI surface; 0: unknown)
    arrived_s: float = 0.0
    #: seconds from arrival to the first token handed to the client (streamed or not); None: none yet
    first_token_s: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    route: list[Hop] = field(default_factory=list)
    #: decode steps sent through the route (one traversal each), drafts they carried, drafts kept
    traversals: int = 0
    drafted: int = 0
    accepted: int = 0
    failovers: int = 0
    #: hop calls failed over because the hop froze (missed its deadline, no liveness answer)
    deadline_misses: int = 0
    #: the tracker verified every shard of every route the generation used, the entry's own included
    #: (ADR-0069); None: not said (no remote hops, or a route from no tracker)
    verified: bool | None = None
    finish_reason: str = "length"
    token_ids: list[int] = field(default_factory=list)
    #: one entry per generated token when the request asked for logprobs (else empty)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def tokens_per_traversal(self) -> float:
        """Tokens chosen per decode traversal (1.0 without speculation; 0.0 before any)."""
        return (self.traversals + self.accepted) / self.traversals if self.traversals else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the decode time (tokens/s)."""
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class OrchestratorSettings:
    """Chunk length of prefill and of a failover's replay (tokens), hop timeouts (seconds; the
    ceiling for a slow but live hop), hop deadlines (when a hop is probed and, if silent, failed
    over: ADR-0036), pipelined prefill on or off, the chain of hop streams on or off (ADR-0040),
    speculative decoding (ADR-0058): None adapts the drafts per step, 0 is off, K drafts K tokens
    whenever the draft source has them (:func:`meshnet.gateway.speculation.parse_speculate`)."""

    chunk_tokens: int = CHUNK_TOKENS
    hop_timeout_s: float = 60.0
    hop_connect_timeout_s: float = 5.0
    pipelined: bool = True
    deadlines: DeadlinePolicy = DeadlinePolicy()
    chain: bool = True
    speculate: int | None = None


class Orchestrator:
    """Runs generations whose first layers are the entry node's own (``entry``), the rest remote.

    Args:
        entry: the entry node's layers, LM head and tokenizer (:class:`EntryLayers`).
        end: this node (shown as the first hop of every route), with its hop stream pool and
            inbox when it has them (:class:`ChainEnd`): then, with ``settings.chain``, the remote
            hops run as a chain.
        link: how this node reaches the mesh (:class:`MeshLink`: client, tracker callbacks, the
            signature on releases).
        observer: counts generations started and finished (the node's metrics), or None.
        traffic: the node's log of sessions in flight and failovers (ADR-0046), or None.
        spot_check: re-runs a share of sessions' first hop calls on other holders (ADR-0042,
            :class:`meshnet.gateway.spotcheck.SpotChecker`), or None.
        step_costs: the route's measured step times by positions, which speculative decoding sizes
            its drafts by (ADR-0058), shared by the sessions of one entry (None: this one's own).
        audit: audits a share of the chains after their sessions end, every hop and position
            (ADR-0067, :class:`meshnet.gateway.audit.Auditor`), or None.
    """

    def __init__(self, entry: EntryLayers, *, end: ChainEnd, link: MeshLink,
                 settings: OrchestratorSettings = OrchestratorSettings(),
                 observer: GenerationObserver | None = None, traffic: TrafficLog | None = None,
                 spot_check: SpotChecker | None = None, step_costs: StepCosts | None = None,
                 audit: Auditor | None = None) -> None:
        self.entry, self.end, self.link = entry, end, link
        self.audit = audit
        self.node_id, self.endpoint = end.node_id, end.endpoint
        self.settings = settings
        self.observer = observer
        self.traffic = traffic
        self.spot_check = spot_check
        self.model = entry.model
        self.num_layers = entry.num_layers
        self.tokenizer = entry.tokenizer
        self.eos_ids = entry.eos_ids
        self.vocab_size = entry.vocab_size
        self.step_costs = step_costs or StepCosts()

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` under the model's chat template (generation prompt added;
        ``tools`` rendered by a template that knows tools)."""
        return self.entry.encode_chat(messages, tools)

    def _remote(self, session_id: str, layers: LayerRange, route) -> RemoteRoute | ChainRoute:
        """The remote hops of one session: a chain of hop streams when the node has them, else HTTP
        calls. A session drawn for a spot-check (ADR-0042) goes hop by hop over HTTP: the check
        needs each hop's input and output, which a chain keeps inside the mesh. A relayed hop
        (ADR-0045) takes part in a chain like any other: its stream runs through the relay's
        tunnel (tests/integration/test_relay.py checks it in a network namespace)."""
        s = self.settings
        checked = self.spot_check is not None and self.spot_check.draw()
        on_failover = None if self.traffic is None else \
            (lambda old, new, why: self.traffic.failover(session_id, old, new, why))
        ctx = RemoteContext(self.link, self.model, self.entry.codec, timeout_s=s.hop_timeout_s,
                            connect_timeout_s=s.hop_connect_timeout_s, deadlines=s.deadlines,
                            replay_chunk_tokens=s.chunk_tokens)
        if s.chain and self.end.pool is not None and self.end.inbox is not None and not checked:
            return ChainRoute(ctx, self.end, route=route, layers=layers, chain_id=session_id, on_failover=on_failover,
                              receipts=self.audit is not None and self.audit.rate > 0)
        return RemoteRoute(ctx, session_id=session_id, route=route, on_failover=on_failover,
                           spot_check=self.spot_check if checked else None)

    async def _step(self, session_id: str, remote: RemoteRoute | ChainRoute | None, ids: list[int], position: int,
                    local: StageOrder, rewind: bool = False) -> Activation:
        """Run ``ids`` at ``position`` through the entry's layers and the route; the last position's
        hidden state, or every position's for a speculative step of several (``rewind``: the
        session's caches first go back to ``position``, forgetting rejected drafts, ADR-0058)."""
        if rewind and local.length > position:
            await local.took(position, 0)
        await local.wait(position)
        hidden = await self.entry.run(session_id, ids, position, rewind)
        await local.took(position, len(ids))
        every = rewind and len(ids) > 1
        if remote is not None:
            hidden = await remote.forward(hidden, position, last_only=not every, rewind=rewind)
        return hidden if every else self.entry.codec.last(hidden)

    async def _prefill(self, session_id: str, remote: RemoteRoute | ChainRoute | None, prompt: list[int],
                       local: StageOrder) -> Activation:
        size = self.settings.chunk_tokens
        chunks = [(p, prompt[p:p + size]) for p in range(0, len(prompt), size)]
        if self.settings.pipelined:
            try:  # a failed chunk cancels its siblings (left running, they would wait on it forever)
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self._step(session_id, remote, c, p, local))
                             for p, c in chunks]
            except BaseExceptionGroup as group_exc:
                raise group_exc.exceptions[0] from None
            return tasks[-1].result()
        hidden = None
        for p, c in chunks:
            hidden = await self._step(session_id, remote, c, p, local)
        return hidden

    async def _open(self, session_id: str) -> RemoteRoute | ChainRoute | None:
        """The remote hops of a new session (None when the entry holds every layer).

        Raises:
            ModelNotRoutable: the tracker has no route for the remote layers.
        """
        if self.entry.local_end >= self.num_layers:
            return None
        layers = LayerRange(self.entry.local_end, self.num_layers)
        route = await self.link.routes(self.model, layers, frozenset(), session_id)
        return self._remote(session_id, layers, route)

    async def score(self, prompt: list[int], top: int = 0) -> list[TokenLogprob | None]:
        """The prompt's own log-probabilities, as OpenAI's ``echo`` with ``logprobs`` returns them:
        None for the first token (nothing precedes it), then each token's natural-log probability
        given those before it, with the ``top`` most likely tokens. One prefill through the mesh,
        chunk after chunk, with every position's hidden state brought back from the last hop
        (``last_only`` off) to the entry's LM head; the session is released at the end.

        Raises:
            ModelNotRoutable, HopFailed: as :meth:`generate`.
        """
        session_id = uuid.uuid4().hex
        remote = await self._open(session_id)
        out: list[TokenLogprob | None] = [None]
        try:
            size = self.settings.chunk_tokens
            for p in range(0, len(prompt), size):
                chunk = prompt[p:p + size]
                hidden = await self.entry.run(session_id, chunk, p)
                if remote is not None:
                    hidden = await remote.forward(hidden, p, last_only=False)
                targets = prompt[p + 1:p + 1 + len(chunk)]  # the last position predicts no prompt token
                if targets:
                    out += await self.entry.score(hidden, targets, top, session_id)
        finally:
            if remote is not None:
                remote.close()
            self.entry.release(session_id)
        return out

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
        entry_hop = Hop(self.node_id, self.endpoint, LayerRange(0, self.entry.local_end))
        remote = await self._open(session_id)
        audited = remote is not None and self.audit is not None and self.audit.draw(remote.hops)
        if audited and isinstance(remote, RemoteRoute):  # the HTTP hop path: the entry keeps each hop's steps
            remote.recording = True
        chooser: TokenChooser = self.entry.new_chooser(params)
        local = StageOrder()  # the entry's own layers
        if self.observer is not None:
            self.observer.generation_started()
        if self.traffic is not None:
            self.traffic.session_started(session_id, self.model, stats,
                                         lambda: [entry_hop] + (remote.hops if remote else []))
        decode = None
        try:
            t0 = time.perf_counter()
            hidden = await self._prefill(session_id, remote, prompt, local)
            stats.prefill_s = time.perf_counter() - t0
            picks = [await self.entry.choose(hidden, chooser, session_id)]
            decode = _Decode(self, session_id, remote, local, chooser, stats, params.max_tokens, prompt)
            self.step_costs.decoding += 1
            t1 = time.perf_counter()
            ended = False
            while not ended:
                for token, logprob in picks:
                    if token in self.eos_ids:
                        stats.finish_reason, ended = "stop", True
                        break
                    stats.completion_tokens += 1
                    stats.token_ids.append(token)
                    if logprob is not None:
                        stats.logprobs.append(logprob)
                    yield token
                    if stats.completion_tokens == 1:
                        t1 = time.perf_counter()
                    if ended := stats.completion_tokens == params.max_tokens:
                        break
                if not ended:
                    picks = await decode.step(picks)
            stats.decode_s = time.perf_counter() - t1
        finally:  # every ending (finish, disconnect, error, failover gave up): free every hop's session
            if decode is not None:
                self.step_costs.decoding -= 1
            if audited:  # its hops' last receipts may still be on their way
                remote.close(linger=True)
                self.audit.audit_soon(remote, self.entry.codec)
            elif remote is not None:
                remote.close()  # in the background, without awaiting: a frozen hop holds up no one
            self.entry.release(session_id)
            if self.traffic is not None:
                self.traffic.session_ended(session_id)
            stats.route = [entry_hop] + (remote.hops if remote else [])
            stats.failovers = remote.failovers if remote else 0
            stats.deadline_misses = remote.deadline_misses if remote else 0
            stats.verified = remote.verified if remote else None
            if self.observer is not None:
                self.observer.generation_finished(stats)


class _Decode:
    """One generation's decode steps after its prefill: plain steps of one token, or speculative
    ones carrying drafts (ADR-0058, :mod:`meshnet.gateway.speculation`) when the orchestrator's
    setting and the model allow (every cache can go back: no recurrent layer)."""

    def __init__(self, orch: Orchestrator, session_id: str, remote: RemoteRoute | ChainRoute | None,
                 local: StageOrder, chooser: TokenChooser, stats: GenerationStats, max_tokens: int,
                 prompt: list[int]) -> None:
        self.orch, self.session_id, self.remote, self.local = orch, session_id, remote, local
        self.chooser, self.stats, self.max_tokens = chooser, stats, max_tokens
        self.position = len(prompt)  # tokens every cache holds (the pending token not yet among them)
        fixed = orch.settings.speculate
        self.policy = None
        if fixed != 0 and orch.entry.can_rewind():
            self.policy = SpeculationPolicy(fixed, orch.step_costs)
            self.drafter = PromptLookup()
            self.drafter.extend(prompt)

    def _draft(self, remaining: int) -> list[int]:
        """The drafts of the next step: at most ``remaining - 1`` (the step yields one token more than
        it keeps drafts) and within the model's context."""
        if self.policy is None:
            return []
        room = remaining - 1
        context = self.orch.entry.context_tokens
        if context:
            room = min(room, context - self.position - 1)
        available = self.drafter.propose(min(room, self.policy.fixed or self.policy.max_drafts))
        return available[:self.policy.drafts(len(available), self.orch.step_costs.decoding)]

    async def step(self, picks: list[tuple[int, TokenLogprob | None]]) -> list[tuple[int, TokenLogprob | None]]:
        """Feed the last of ``picks`` (the tokens chosen since the previous step, all handed out)
        with the next drafts; the new picks (at least one)."""
        token = picks[-1][0]
        if self.policy is not None:
            self.drafter.extend([t for t, _ in picks])
        drafts = self._draft(self.max_tokens - self.stats.completion_tokens)
        ids = [token] + drafts
        t0 = time.perf_counter()
        orch = self.orch
        hidden = await orch._step(self.session_id, self.remote, ids, self.position, self.local,
                                  rewind=self.policy is not None)
        if drafts:
            out = await orch.entry.verify(hidden, self.chooser, self.session_id, drafts,
                                          self.max_tokens - self.stats.completion_tokens)
        else:
            out = [await orch.entry.choose(hidden, self.chooser, self.session_id)]
        kept = 0  # the drafts the picks confirmed, from the first on
        while kept < min(len(out), len(drafts)) and out[kept][0] == drafts[kept]:
            kept += 1
        if self.policy is not None:
            self.policy.observe(len(drafts), kept, len(ids), time.perf_counter() - t0)
        self.stats.traversals += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += kept
        self.position += 1 + kept
        return out
