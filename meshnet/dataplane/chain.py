"""One session's remote layers as a chain of hop streams, with deadlines and failover (ADR-0040).

The entry sends OPEN (route, tickets, its own endpoint) and then one STEP per prefill chunk or
decode step to the first remote hop; each hop runs its layers and pushes its output to the
next hop; the last hop sends the RESULT straight back to the entry (its stream endpoint, not
back along the chain). Messages are :mod:`meshnet.dataplane.frames`; connections come from the
node's :class:`meshnet.dataplane.transport.StreamPool` and are shared with other sessions.

A step's deadline is derived from the chain's own observed step times (floor 0.5 s,
:mod:`meshnet.dataplane.deadlines`, ADR-0036). When it passes, every hop is probed
(``GET /v1/health?chain=ID``); a silent hop is frozen, and one that answers without holding the
chain lost it (it restarted, or dropped the chain because it could not pass a step on, to its
next hop or to the entry: nobody is left to tell the entry). That hop is kept out of the new
chain but not reported. A hop's ERROR message (it failed, or it could
not reach its next hop and names that one) fails the chain at once; so does a RESULT that does
not decode or has the wrong shape (the last hop, which sent it, failed). Either way the entry
excludes the hop, reports it (not when it was only busy), releases the old chain on every hop
in the background, asks the tracker for a new route over all the remote layers without it,
and replays everything sent so far as chunked prefill (:func:`meshnet.dataplane.replay.rechunk`)
down the new chain under a fresh chain id, then resends the steps still in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from meshnet.errors import HEALTHY_HOP_CODES, HopBusy, HopFailed, MeshnetError, WireError
from meshnet.dataplane.codec import Activation
from meshnet.dataplane.deadlines import deadline_s
from meshnet.dataplane.failover import CHAIN_LOST, Failover, FailoverCounts, FailoverListener, RemoteContext, describe
from meshnet.dataplane.receipts import digest
from meshnet.dataplane.replay import cut_history, rechunk
from meshnet.dataplane.transport import StreamPool
from meshnet.layers import LayerRange
from meshnet.protocol.ids import NodeId, SessionId
from meshnet.protocol.route import Hop, Route
from meshnet.dataplane.frames import FLAG_LAST_ONLY, FLAG_NO_RESULT, FLAG_REWIND, ChainError, ChainOpen, Kind, \
    Message, new_chain_id, new_chain_key, pack, same_key

log = logging.getLogger(__name__)

#: most receipts a chain keeps (a session of 65,536 steps over 4 hops is far longer than any)
MAX_RECEIPTS = 262_144

__all__ = ["CHAIN_LOST", "ChainEnd", "ChainInbox", "ChainRecord", "ChainRoute", "StageOrder"]


class StageOrder:
    """The one ordering rule of a pipeline stage: a stage takes the step at position ``p`` only
    once it holds exactly ``p`` tokens, so steps sent concurrently (pipelined prefill chunks) still
    reach it in position order. The entry's own layers, a chain and each hop of the HTTP path
    keep one each.

    Attributes:
        length: tokens the stage holds (the position of the next step it takes).
        cond: the condition waiters wait on (several stages may share one).
    """

    def __init__(self, cond: asyncio.Condition | None = None) -> None:
        self.cond = cond or asyncio.Condition()
        self.length = 0

    def holds(self, position: int) -> bool:
        """Whether the step at ``position`` is the stage's next."""
        return self.length == position

    async def wait(self, position: int) -> None:
        """Until the step at ``position`` is the stage's next."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.holds(position))

    async def took(self, position: int, tokens: int) -> None:
        """The stage took ``tokens`` tokens at ``position``: the next step's turn."""
        async with self.cond:
            self.length = position + tokens
            self.cond.notify_all()


class ChainInbox:
    """Where RESULT and ERROR messages reaching this node find their chain (by chain id)."""

    def __init__(self) -> None:
        self._chains: dict[str, "ChainRoute"] = {}

    def register(self, chain_id: SessionId, chain: "ChainRoute") -> None:
        self._chains[chain_id] = chain

    def unregister(self, chain_id: SessionId) -> None:
        self._chains.pop(chain_id, None)

    def deliver(self, message: Message) -> bool:
        """Hand ``message`` to its chain; False when no chain here has its id (a late message)."""
        chain = self._chains.get(message.chain_id)
        if chain is None:
            return False
        chain.deliver(message)
        return True

    def __len__(self) -> int:
        return len(self._chains)


@dataclass(frozen=True)
class ChainRecord:
    """One chain as its entry saw it, for an audit (ADR-0067): the ``model``, ``chain_id``, chain
    ``key`` and ``ticket``, its remote ``hops``, the frames the entry sent down it (``sent``:
    ``(position, SHA-256 of the frame)`` in order; ``sent_frames`` the frames themselves), the
    hops' ``receipts`` as they came (``(hop index, position, flags, RECEIPT body)``) and the result
    frames the last hop sent back (``results``): with the other hops' transcripts, the frames a hop
    that withholds its own took and sent (:func:`meshnet.dataplane.receipts.rebuild_transcript`)."""

    model: str | None
    chain_id: str
    key: str
    ticket: str | None
    hops: tuple[Hop, ...]
    sent: tuple[tuple[int, bytes], ...]
    receipts: tuple[tuple[int, int, int, bytes], ...]
    failed_over: bool = False  # the chain replaced another: its first steps replayed the history
    sent_frames: tuple[bytes, ...] = ()
    results: tuple[bytes, ...] = ()
    #: the HTTP hop path's own record (:meth:`meshnet.dataplane.hops.RemoteRoute.audit_record`): each
    #: hop's steps as this entry sent and received them (None: a chain, whose hops' are fetched), the
    #: ``(position, digest)`` sent to each hop, and each hop's ticket (a replaced hop has its own)
    transcripts: tuple[list, ...] | None = None
    sent_to: tuple[tuple[tuple[int, bytes], ...], ...] = ()
    hop_tickets: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class ChainEnd:
    """An entry node as its chains see it: its ``node_id`` and ``endpoint`` (the last hop returns
    results there, any hop sends errors there), its outbound stream ``pool`` and the ``inbox`` its
    stream endpoint hands RESULT and ERROR messages to (both None: no hop streams, the HTTP path)."""

    node_id: NodeId
    endpoint: str
    pool: StreamPool | None = None
    inbox: ChainInbox | None = None


class ChainRoute(FailoverCounts):
    """The remote part of one session's route, driven as a chain of hop streams.

    Args:
        ctx: the entry's link to the mesh and hop settings (:class:`RemoteContext`).
        end: this entry node as its chains see it (:class:`ChainEnd`: results come back there).
        route: the first route over ``layers`` (its ticket for ``chain_id``).
        layers: the remote layers the chain covers.
        chain_id: the session id the hops use for the first chain (32 hex characters).
        on_failover: told of the failed hop and the new chain's hops over its layers after each
            chain replacement (the traffic log, ADR-0046; None: nobody).
        receipts: ask every hop for a signed receipt of each step (ADR-0067: this entry audits a
            share of its sessions; the same for every session, audited or not).
    """

    def __init__(self, ctx: RemoteContext, end: "ChainEnd", *, route: Route, layers: LayerRange, chain_id: SessionId,
                 on_failover: FailoverListener | None = None, receipts: bool = False) -> None:
        self.want_receipts = receipts
        self.pool, self.inbox = end.pool, end.inbox
        self.fo = Failover(ctx, chain_id, on_failover)
        self.fo.routes_verified.append(route.verified)
        self.model, self.entry_id, self.entry_endpoint = ctx.model, end.node_id, end.endpoint
        self.layers, self.codec = layers, ctx.codec
        self.timeout_s, self.max_failovers = ctx.timeout_s, ctx.max_failovers
        self.replay_chunk_tokens = ctx.replay_chunk_tokens
        self.times = self.fo.new_times()
        #: everything sent so far, contiguous from position 0: ``(position, frame, tokens, flags)``
        self.history: list[tuple[int, bytes, int, int]] = []
        #: the current chain's step receipts as they came (ADR-0067): (hop index, position, flags, 128-byte body)
        self.receipts: list[tuple[int, int, int, bytes]] = []
        #: (position, SHA-256) of every frame sent down the current chain, in order (what its first hop received)
        self.sent: list[tuple[int, bytes]] = []
        self.sent_frames: list[bytes] = []  # the frames of ``sent`` (a rewind does not cut them)
        self.results: list[bytes] = []  # the current chain's RESULT frames as they came
        self.order = StageOrder()  # ``length``: tokens sent down the chain so far
        self.replayed_tokens = 0
        self._futures: dict[int, asyncio.Future] = {}
        self._dead: HopFailed | None = None
        self._closed = False
        self._opened = False
        self.chain_id: SessionId | None = None
        self.epoch = -1  # +1 with every chain installed: a failure is failed over once per chain
        self._install(route, chain_id)

    # ---- chain lifecycle --------------------------------------------------------------

    def _install(self, route: Route, chain_id: SessionId) -> None:
        """Make ``route`` under ``chain_id`` the current chain (nothing sent yet)."""
        if not route.hops or route.hops[0].layers.start != self.layers.start or \
                route.hops[-1].layers.end != self.layers.end:
            raise HopFailed(f"the route {[str(h.layers) for h in route.hops]} does not cover layers {self.layers}")
        if self.chain_id is not None:
            self.inbox.unregister(self.chain_id)
        self.hops, self.ticket, self.chain_id = list(route.hops), route.ticket, chain_id
        self.receipts, self.sent, self.sent_frames, self.results = [], [], [], []
        self.key = new_chain_key()  # every chain its own: a failed-over chain's hops cannot speak for the new one
        self.epoch += 1
        self.broken: asyncio.Future = asyncio.get_running_loop().create_future()
        self.inbox.register(chain_id, self)
        self._opened = False

    def _sent(self, position: int, frame: bytes) -> None:
        """Keep a frame sent down the current chain (a step, or a failover's replay of the history):
        what its first hop must have signed as received, for an audit (ADR-0067)."""
        if self.want_receipts:
            self.sent.append((position, digest(frame)))
            self.sent_frames.append(frame)

    def forget(self) -> None:
        """Take no more messages for the current chain (after a lingering :meth:`close`)."""
        self.inbox.unregister(self.chain_id)

    def audit_record(self) -> "ChainRecord":
        """What an audit of the current chain needs (ADR-0067): its hops, id, key and ticket, the
        frames this entry sent down it and the hops' receipts (a snapshot: the chain may go on)."""
        return ChainRecord(self.model, self.chain_id, self.key, self.ticket, tuple(self.hops), tuple(self.sent),
                           tuple(self.receipts), self.epoch > 0, tuple(self.sent_frames), tuple(self.results))

    def _release(self, abandoned: bool) -> None:
        """Release the current chain's session on each of its hops, in the background."""
        self.fo.release([(h.endpoint, self.ticket) for h in self.hops], self.chain_id, abandoned=abandoned)

    def close(self, linger: bool = False) -> None:
        """End the session on every hop at once: the releases go out in the background (returns
        at once, never raises; safe while the generation is being cancelled). With ``linger`` the
        chain still takes its hops' late receipts until :meth:`forget` (an audit waits for them)."""
        if self._closed:
            return
        self._closed = True
        if not linger:
            self.inbox.unregister(self.chain_id)
        for fut in self._futures.values():
            if not fut.done():
                fut.cancel()
        if self._opened:
            try:
                self._release(abandoned=False)
            except RuntimeError:  # no running loop (interpreter shutdown): the hops' TTL frees them
                pass

    # ---- messages in ------------------------------------------------------------------

    def deliver(self, message: Message) -> None:
        """A RESULT or ERROR of this chain (called by :class:`ChainInbox`; never blocks). One that
        does not carry the current chain's key is dropped: only the chain's hops know it (ADR-0049)."""
        if message.chain_id != self.chain_id or not same_key(message, self.key):
            log.warning("%s for chain %s without its key dropped", message.kind.name, message.chain_id)
            return
        if message.kind == Kind.RESULT:
            fut = self._futures.get(message.position)
            if fut is not None and not fut.done():
                fut.set_result((self.epoch, message.body))  # the chain that sent it, should it be unusable
        elif message.kind == Kind.ERROR and not self.broken.done():
            self.broken.set_result(self._error_of(message))
        elif message.kind == Kind.RECEIPT and 0 < message.hop_index <= len(self.hops) \
                and len(self.receipts) < MAX_RECEIPTS:
            self.receipts.append((message.hop_index - 1, message.position, message.flags, message.body))

    def _error_of(self, message: Message) -> HopFailed:
        try:
            err = ChainError.from_body(message.body)
        except MeshnetError as exc:  # its sender is at fault: it names itself in the header
            sender = self.hops[message.hop_index - 1] if 0 < message.hop_index <= len(self.hops) else None
            return HopFailed(f"{describe(sender) if sender else 'the chain'} sent an unreadable error: {exc.message}",
                             node_id=sender.node_id if sender else None)
        where = next((describe(h) for h in self.hops if h.node_id == err.node_id), f"hop {err.node_id}")
        text = f"{where} failed: {err.status} {err.code}: {err.message}"
        blamed = None if err.node_id == self.entry_id else err.node_id  # this node's own frame: nobody to exclude
        if err.status == 503:
            return HopBusy(text, node_id=blamed)
        return HopFailed(text, node_id=blamed, code=err.code if err.code in HEALTHY_HOP_CODES else None)

    # ---- messages out -----------------------------------------------------------------

    async def _send(self, kind: Kind, position: int = 0, flags: int = 0, body: bytes = b"") -> None:
        """One message to the first hop of the current chain; a failure breaks the chain."""
        first = self.hops[0]
        try:
            await self.pool.send(first.endpoint, pack(kind, self.chain_id, key=self.key, position=position, flags=flags,
                                                      body=body))
        except MeshnetError as exc:
            if not self.broken.done():
                self.broken.set_result(HopFailed(f"{describe(first)} is unreachable: {exc.message}",
                                                 node_id=first.node_id))

    async def _open(self) -> None:
        opened = ChainOpen(model=self.model, entry=self.entry_id, entry_endpoint=self.entry_endpoint,
                           hops=[h.to_json() for h in self.hops], tickets=[self.ticket] * len(self.hops),
                           receipts=self.want_receipts)
        self._opened = True
        await self._send(Kind.OPEN, body=opened.to_body())

    async def forward(self, hidden: Activation, position: int, *, last_only: bool, rewind: bool = False) -> Activation:
        """Run ``hidden`` ``[1, seq, hidden]`` at ``position`` down the chain; the last hop's output
        (only its last position with ``last_only``). Calls may overlap (pipelined prefill): they
        are sent in position order and each waits for its own result.

        With ``rewind`` (a speculative step, ADR-0058: no other step of the chain in flight)
        ``position`` may be below what the chain holds: the positions from it on are forgotten from
        the history (:func:`cut_history`) and, by :data:`FLAG_REWIND`, on every hop.

        Raises:
            HopBusy, HopFailed: no replacement chain, or ``max_failovers`` replacements failed.
        """
        shape = self.codec.shape(hidden)
        frame = await self.codec.encode(hidden)
        flags = (FLAG_LAST_ONLY if last_only else 0) | (FLAG_REWIND if rewind else 0)
        fut = asyncio.get_running_loop().create_future()
        async with self.order.cond:
            if rewind and position < self.order.length:
                if self._futures:  # its positions would never come round again: a caller's error, said at once
                    raise RuntimeError(f"chain {self.chain_id}: a rewind to {position} while steps are in flight")
                self.history = await cut_history(self.history, position, self.codec)
                self.order.length = position
            await self.order.cond.wait_for(lambda: self.order.holds(position) or self._dead is not None)
            if self._dead is not None:
                raise self._dead
            self._futures[position] = fut
            self.history.append((position, frame, shape[1], flags))
            self.order.length = position + shape[1]
            if not self._opened:
                await self._open()
            await self._send(Kind.STEP, position, flags, frame)
            self._sent(position, frame)
            self.order.cond.notify_all()
        try:
            return await self._result(position, fut, shape[1], (1, 1 if last_only else shape[1], shape[-1]))
        finally:
            self._futures.pop(position, None)

    async def _result(self, position: int, fut: asyncio.Future, tokens: int, want: tuple[int, ...]) -> Activation:
        """The result of the step at ``position`` (of shape ``want``), failing the chain over as often
        as needed. A RESULT that does not decode or has another shape is its chain's last hop
        failing: the step waits on a fresh future in ``self._futures`` for its result on the new chain.

        Raises:
            HopBusy, HopFailed: see :meth:`forward`; or the chain, alive, took over ``timeout_s``.
        """
        t0 = time.perf_counter()
        start_epoch = self.epoch
        while True:
            epoch, broken = self.epoch, self.broken
            extra = self.replayed_tokens if epoch != start_epoch else 0
            deadline = deadline_s(self.fo.policy, self.times, tokens + extra)
            await asyncio.wait({fut, broken}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
            if fut.done():
                sent_by, body = fut.result()
                fut = self._futures[position] = asyncio.get_running_loop().create_future()  # for a resend
                try:
                    out = await self._decode(body, want)
                except MeshnetError as exc:  # (from a chain replaced since: nothing to fail, the step was resent)
                    await self._failover(sent_by, HopFailed(f"{describe(self.hops[-1])} sent an unusable result: "
                                                            f"{exc.message}", node_id=self.hops[-1].node_id))
                    continue
                if self.epoch == start_epoch:
                    self.times.observe(tokens, time.perf_counter() - t0)
                if self.want_receipts and sent_by == self.epoch:  # what the last hop signed as sent, for an audit
                    self.results.append(body)
                return out
            if self._dead is not None:
                raise self._dead
            if broken.done():
                await self._failover(epoch, broken.result())
                continue
            silent, lost = await self.fo.probe(list(self.hops), self.chain_id)
            if fut.done():
                continue
            if silent:
                exc = self.fo.frozen(silent[0], deadline, tokens)
                await self._failover(epoch, exc, also=[h.node_id for h in silent[1:]], frozen=True)
                continue
            if lost:
                exc = HopFailed(f"{describe(lost[0])} answers but no longer holds chain {self.chain_id} (it "
                                f"restarted, or could not pass the step on to its next hop or the entry)",
                                node_id=lost[0].node_id, code=CHAIN_LOST)
                await self._failover(epoch, exc)
                continue
            if time.perf_counter() - t0 > self.timeout_s:
                raise HopFailed(f"the chain over layers {self.layers} took over {self.timeout_s:.0f} s on "
                                f"{tokens} token(s) while every hop answered its probe")
            log.info("chain %s is slow but alive (%.2f s on %d token(s), deadline %.2f s)",
                     self.chain_id, time.perf_counter() - t0, tokens, deadline)

    async def _decode(self, body: bytes, want: tuple[int, ...]) -> Activation:
        """The activation of a RESULT body.

        Raises:
            MeshnetError: the body does not decode, or its shape is not ``want``.
        """
        out = await self.codec.decode(body)
        if tuple(self.codec.shape(out)) != want:
            raise WireError(f"shape {list(self.codec.shape(out))}, expected {list(want)}")
        return out

    # ---- failover ---------------------------------------------------------------------

    async def _failover(self, epoch: int, exc: HopFailed, also: list[str] = (), frozen: bool = False) -> None:
        """Replace the chain of ``epoch`` (once, however many steps saw it fail): exclude and
        report the failed hop(s), release the old chain, replay the history down a new one.
        ``frozen``: the chain missed its deadline and a hop did not answer the probe (counted once).

        Raises:
            HopBusy, HopFailed: no route without the failed hops, or ``max_failovers`` chains failed.
        """
        async with self.order.cond:
            if self._dead is not None:
                raise self._dead
            if self.epoch != epoch:
                return
            self.fo.deadline_misses += frozen
            for node_id in also:
                self.fo.exclude(HopFailed(f"hop {node_id} is silent", node_id=node_id), self.ticket)
            old_hops = list(self.hops)
            for _ in range(self.max_failovers):
                log.warning("%s; failing the chain over", exc.message)
                self.fo.exclude(exc, self.ticket)
                self._release(abandoned=True)
                chain_id = new_chain_id()
                try:
                    self._install(await self.fo.new_route(self.layers, exc, chain_id), chain_id)
                except HopFailed as none_left:  # HopBusy too
                    self._die(none_left)
                await self._replay()
                if not self.broken.done():
                    self._tell_failover(old_hops, exc)
                    self.order.cond.notify_all()
                    return
                exc = self.broken.result()
            self._die(HopFailed(f"{exc.message}; {self.max_failovers} replacement chains over layers "
                                f"{self.layers} failed", node_id=exc.node_id))

    def _tell_failover(self, old_hops: list[Hop], exc: HopFailed) -> None:
        """Count the failover; tell the listener of the hop that failed and the new chain's hops
        over its layers."""
        failed = next((h for h in old_hops if h.node_id == exc.node_id), old_hops[0] if old_hops else None)
        if failed is None:  # (a chain always has hops)
            self.fo.failovers += 1
            return
        replacement = [h for h in self.hops if h.layers.start <= failed.layers.end - 1
                       and failed.layers.start <= h.layers.end - 1]
        self.fo.replaced(failed, replacement, exc.message)

    def _die(self, exc: HopFailed) -> None:
        self._dead = exc
        self.order.cond.notify_all()
        raise exc

    async def _replay(self) -> None:
        """OPEN the new chain, send the history of finished steps as prefill chunks (no results
        wanted), then resend the steps still in flight as they were."""
        await self._open()
        pending = min(self._futures) if self._futures else self.order.length
        done = [(p, frame, t) for p, frame, t, _ in self.history if p < pending]
        async for position, frame, tokens in rechunk(done, self.codec, self.replay_chunk_tokens):
            await self._send(Kind.STEP, position, FLAG_NO_RESULT, frame)
            self._sent(position, frame)
        for position, frame, _, flags in self.history:
            if position >= pending:
                await self._send(Kind.STEP, position, flags, frame)
                self._sent(position, frame)
        self.replayed_tokens = self.order.length
