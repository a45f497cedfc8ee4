"""Remote hops of one session: forward calls under deadlines, input history, failover by replay.

Each hop keeps every input frame it was sent (with its position) for the life of the
session. When a hop fails, the orchestrator reports it, asks for a new route over the same
layers without the failed node, replays the history to the replacement as prefill chunks
(:mod:`meshnet.dataplane.replay`: the same KV cache in ``ceil(tokens / chunk)`` calls), and goes on.

Every error on a hop call is that hop's failure (:class:`HopFailed`): a refused or slow
connection, an unusable URL, a non-200 answer, a reply frame that does not decode or has
the wrong shape. So is a hop that misses its deadline (derived from its own observed call
times, :mod:`meshnet.dataplane.deadlines`) and then does not answer a liveness probe: it is
frozen (docs/adr/0036-hop-deadlines.md). A hop that answers 503 (session cache full,
draining) is *busy* (:class:`HopBusy`): it is replaced the same way but not reported to the
tracker, since it is healthy. A hop that answers 409 ``session_conflict`` lost the session
(expired or restarted): it is neither reported nor excluded, so the replay may restart the
session on it. When no replacement exists the error names the hop and its layers.

Every hop call carries the session's ticket from the tracker (``X-Meshnet-Ticket``, ADR-0038):
each hop keeps the ticket of the route that named it, so a replacement uses the fresh ticket
its new route came with. A hop's 403 or 401 (a ticket it does not accept) is its failure like
any other answer, except ``ticket_expired``: a session that outlives its ticket asks the
tracker for the hop's layers again and replays to the hop the new route names, like a
hop that lost the session (that is how a ticket is renewed).

Every hop that was sent a frame is released (``DELETE /v1/sessions/{id}``, with its ticket and
signed by the entry node's key when it has one) in the
background: an excluded hop at once, the others when the generation ends. Nothing waits
for a release, so a frozen node delays no one; its session goes when it resumes (the
release is patient) or by its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from meshnet.errors import HEALTHY_HOP_CODES, HopBusy, HopFailed, MeshnetError
from meshnet.dataplane.deadlines import StepTimes, deadline_s
from meshnet.dataplane.codec import Activation, ActivationCodec
from meshnet.dataplane.chain import ChainRecord, StageOrder
from meshnet.dataplane.failover import Failover, FailoverCounts, FailoverListener, RemoteContext, Touched, describe
from meshnet.dataplane.receipts import HEADER_RECEIPT, TranscriptStep, digest
from meshnet.dataplane.frames import FLAG_LAST_ONLY, FLAG_REWIND, HEADER_REWIND
from meshnet.dataplane.replay import cut_history, rechunk
from meshnet.protocol.ids import SessionId
from meshnet.protocol.route import Hop, Route
from meshnet.protocol.signing import unb64url
from meshnet.protocol.tickets import HEADER_TICKET

log = logging.getLogger(__name__)


@dataclass
class HopState:
    """A hop plus what it has been sent: ``history`` of ``(position, frame, tokens)``, its
    ``order`` (the tokens it holds: :class:`StageOrder`), how long its calls took (``times``, for its
    deadline), and the ticket of the route that named it (None: a mesh without tickets)."""

    hop: Hop
    order: StageOrder
    ticket: str | None = None
    history: list[tuple[int, bytes, int]] = field(default_factory=list)
    times: StepTimes = field(default_factory=StepTimes)
    #: a session drawn for an audit (:attr:`RemoteRoute.recording`): every call's step as the hop ran
    #: it and the receipt it signed (``X-Meshnet-Receipt``; "" when none came), in order (ADR-0067)
    steps: list[TranscriptStep] = field(default_factory=list)
    receipts: list[str] = field(default_factory=list)


def _error_of(resp: httpx.Response) -> tuple[str, str]:
    """``(code, message)`` of an error answer (the OpenAI envelope when there is one)."""
    try:
        err = resp.json().get("error") or {}
        return str(err.get("code") or "http_error"), str(err.get("message") or resp.text[:200])
    except (ValueError, AttributeError):
        return "http_error", resp.text[:200]


async def post_forward(client: httpx.AsyncClient, hop: Hop, *, model: str, session_id: SessionId, position: int,
                       frame: bytes, last_only: bool, timeout: httpx.Timeout | float,
                       codec: ActivationCodec, expect_shape: tuple[int, ...] | None = None,
                       ticket: str | None = None, rewind: bool = False,
                       receipts: list[str] | None = None) -> tuple[bytes, Activation]:
    """``POST {endpoint}/v1/forward`` with one activation frame.

    Args:
        rewind: a speculative step: the hop may first take the session back to ``position``
            (:data:`HEADER_REWIND`, ADR-0058).
        ticket: the session's ticket naming this hop (sent as ``X-Meshnet-Ticket``; None: none).
        timeout: the whole call (seconds) or an ``httpx.Timeout`` with its own connect limit.
        expect_shape: the output shape the reply must have (None: any).
        receipts: where to append the hop's signed receipt of the call (its ``X-Meshnet-Receipt``,
            "" when it sent none; ADR-0067), or None.

    Returns:
        ``(reply frame, decoded tensor)``: the frame goes on to the next hop unchanged.

    Raises:
        HopBusy: the hop answered 503 (it is healthy but takes no new work now).
        HopFailed: any other error: transport, timeout, unusable URL, a non-200 answer, or a reply
            that ``codec`` cannot decode or that does not have ``expect_shape``.
    """
    start, end = hop.layers.to_inclusive()
    headers = {"X-Meshnet-Model": model, "X-Meshnet-Session": session_id, "X-Meshnet-Start-Layer": str(start),
               "X-Meshnet-End-Layer": str(end), "X-Meshnet-Position": str(position),
               "Content-Type": "application/octet-stream"}
    if last_only:
        headers["X-Meshnet-Last-Only"] = "1"
    if rewind:
        headers[HEADER_REWIND] = "1"
    if ticket:
        headers[HEADER_TICKET] = ticket
    try:
        resp = await client.post(f"{hop.endpoint}/v1/forward", content=frame, headers=headers, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - InvalidURL, StreamError, OSError...: all this hop's failure
        raise HopFailed(f"{describe(hop)} failed: {type(exc).__name__}: {exc}", node_id=hop.node_id) from exc
    if resp.status_code == 503:
        code, message = _error_of(resp)
        raise HopBusy(f"{describe(hop)} refused the session ({code}): {message}", node_id=hop.node_id, code=code)
    if resp.status_code != 200:
        code, message = _error_of(resp)
        raise HopFailed(f"{describe(hop)} answered {resp.status_code} ({code}): {message}", node_id=hop.node_id,
                        code=code if code in HEALTHY_HOP_CODES else None)
    try:
        out = await codec.decode(resp.content)
    except MeshnetError as exc:
        raise HopFailed(f"{describe(hop)} sent a bad activation frame: {exc.message}", node_id=hop.node_id) from exc
    if expect_shape is not None and codec.shape(out) != tuple(expect_shape):
        raise HopFailed(f"{describe(hop)} sent shape {list(codec.shape(out))}, expected {list(expect_shape)}",
                        node_id=hop.node_id)
    if receipts is not None:
        receipts.append(resp.headers.get(HEADER_RECEIPT, ""))
    return resp.content, out


def _settle(call: asyncio.Future) -> None:
    """Cancel an abandoned call; mark its outcome as seen when it had already ended."""
    if not call.done():
        call.cancel()
    elif not call.cancelled():
        call.exception()


class RemoteRoute(FailoverCounts):
    """The remote part of one session's route, with deadlines and failover.

    Args:
        ctx: the entry's link to the mesh and hop settings (:class:`RemoteContext`; ``timeout_s``
            is per hop call here).
        session_id: id of the generation (``X-Meshnet-Session``).
        route: the initial hops, in layer order, and their ticket.
        on_failover: told of each hop replaced, once its replacement has taken the replay (or None).
        spot_check: checks this session's first call to each hop against other holders; given only
            for a session the caller drew for checking (ADR-0042, :mod:`meshnet.gateway.spotcheck`;
            None: not checked).
    """

    def __init__(self, ctx: RemoteContext, *, session_id: SessionId, route: Route,
                 on_failover: FailoverListener | None = None, spot_check=None) -> None:
        self.ctx, self.session_id = ctx, session_id
        self.fo = Failover(ctx, session_id, on_failover)
        self.fo.routes_verified.append(route.verified)
        self.client, self.model, self.codec = ctx.link.client, ctx.model, ctx.codec
        self.max_failovers, self.replay_chunk_tokens = ctx.max_failovers, ctx.replay_chunk_tokens
        self.timeout = httpx.Timeout(ctx.timeout_s, connect=min(ctx.connect_timeout_s, ctx.timeout_s))
        self.spot_check = spot_check  # this session was drawn for a spot-check (the caller draws)
        hops = route.hops
        self._turn = asyncio.Condition()  # shared by every hop's StageOrder
        self.states = [self._new_state(h, route.ticket) for h in hops]
        self.start_layer = hops[0].layers.start if hops else 0
        self.end_layer = hops[-1].layers.end if hops else 0
        self.hidden_size: int | None = None
        #: node id -> (endpoint, ticket) of every hop sent a frame, not yet released
        self._touched: dict[str, Touched] = {}
        #: keep each call's step and receipt for an audit of this session (the caller draws it
        #: before the first step; every hop signs every call anyway, so none can tell, ADR-0067)
        self.recording = False

    def _new_state(self, hop: Hop, ticket: str | None) -> HopState:
        return HopState(hop, StageOrder(self._turn), ticket=ticket, times=self.fo.new_times())

    @property
    def hops(self) -> list[Hop]:
        return [s.hop for s in self.states]

    def _state_at(self, layer: int) -> HopState:
        return next(s for s in self.states if s.hop.layers.start == layer)

    async def _alive(self, hop: Hop) -> bool:
        silent, _ = await self.fo.probe([hop])
        return not silent

    async def _send(self, state: HopState, frame: bytes, position: int, seq_len: int,
                    last_only: bool, check: bool = False, rewind: bool = False) -> tuple[bytes, Activation]:
        """One forward call under the hop's deadline (see :meth:`_await_in_time`); records its time.
        With ``check``, a position-0 call of a session drawn for a spot-check is checked before
        it counts (:meth:`_spot_check`).

        Raises:
            HopBusy, HopFailed: as :func:`post_forward`, or the hop froze (missed its deadline and
                did not answer the liveness probe), or a spot-check outvoted it.
        """
        shape = None if self.hidden_size is None else (1, 1 if last_only else seq_len, self.hidden_size)
        self._touched[state.hop.node_id] = (state.hop.endpoint, state.ticket)
        t0 = time.perf_counter()
        checking = check and position == 0 and self.spot_check is not None
        receipts: list[str] | None = [] if checking or self.recording else None
        call = asyncio.ensure_future(post_forward(
            self.client, state.hop, model=self.model, session_id=self.session_id, position=position,
            frame=frame, last_only=last_only, timeout=self.timeout, codec=self.codec, expect_shape=shape,
            ticket=state.ticket, rewind=rewind, receipts=receipts))
        try:
            out = await self._await_in_time(state, call, seq_len, t0)
        finally:
            _settle(call)
        state.times.observe(seq_len, time.perf_counter() - t0)
        if checking:
            await self._spot_check(state, frame, out[0], last_only, receipts[0] if receipts else "")
        if self.recording:
            flags = (FLAG_LAST_ONLY if last_only else 0) | (FLAG_REWIND if rewind else 0)
            state.steps.append(TranscriptStep(position, seq_len, flags, frame, out[0]))
            state.receipts.append(receipts[0] if receipts else "")
        state.history.append((position, frame, seq_len))
        state.order.length = position + seq_len
        return out

    async def _spot_check(self, state: HopState, frame: bytes, output: bytes, last_only: bool, receipt: str) -> None:
        """Check the hop's first output (``receipt``: the hop's signed receipt of it) against other
        holders; when the vote outvotes the hop it is failed over like a failed hop (its call does
        not count, its replacement replays).

        Raises:
            HopFailed: the hop was outvoted (and reported for quarantine).
        """
        loser = await self.spot_check.check(model=self.model, hop=state.hop, frame=frame, output=output,
                                            last_only=last_only, codec=self.codec, session_id=self.session_id,
                                            exclude=frozenset(self.failed), ticket=state.ticket, receipt=receipt)
        if loser == state.hop.node_id:
            raise HopFailed(f"{describe(state.hop)} was outvoted by a spot-check and quarantined",
                            node_id=state.hop.node_id)

    async def _await_in_time(self, state: HopState, call: asyncio.Future, seq_len: int, t0: float):
        """The call's result. Each time it runs past the hop's deadline the hop is probed: a live
        hop gets another deadline (up to the call timeout), a silent one is frozen.

        Raises:
            HopFailed: the call failed, or the hop froze.
        """
        deadline = deadline_s(self.fo.policy, state.times, seq_len)
        while True:
            done, _ = await asyncio.wait({call}, timeout=deadline)
            if done:
                return call.result()
            alive = await self._alive(state.hop)
            if call.done():  # it answered while we probed
                return call.result()
            if not alive:
                self.fo.deadline_misses += 1
                raise self.fo.frozen(state.hop, deadline, seq_len)
            log.info("hop %s is slow but alive (%.2f s on %d token(s), deadline %.2f s)",
                     state.hop.node_id, time.perf_counter() - t0, seq_len, deadline)

    async def run_stage(self, layer: int, frame: bytes, position: int, seq_len: int,
                        last_only: bool, rewind: bool = False) -> tuple[bytes, Activation, int]:
        """Send ``frame`` (``seq_len`` tokens at ``position``) through the hop starting at ``layer``.

        Waits until that hop has received every earlier position (chunks stay in order even
        when prefill is pipelined); on failure (a frozen hop included) replaces the hop and retries.

        Returns:
            ``(output frame, output tensor, next layer)``.

        Raises:
            HopBusy: the hop is busy and no other node serves its layers (503).
            HopFailed: no replacement, or ``max_failovers`` replacements all failed (502).
        """
        last: HopFailed | None = None
        for _ in range(self.max_failovers + 1):
            async with self._turn:
                await self._turn.wait_for(lambda: self._state_at(layer).order.holds(position))
                state = self._state_at(layer)
            is_final = state.hop.layers.end == self.end_layer
            try:
                out, tensor = await self._send(state, frame, position, seq_len, last_only and is_final, check=True,
                                               rewind=rewind)
                async with self._turn:
                    self._turn.notify_all()
                return out, tensor, state.hop.layers.end
            except HopFailed as exc:
                log.warning("%s; failing over", exc.message)
                last = exc
                await self._replace(state, exc)
        raise HopFailed(f"the hops from layer {layer} failed {self.max_failovers + 1} times; last: {last.message}",
                        node_id=last.node_id)

    def _exclude(self, exc: HopFailed) -> None:
        """Exclude the failed hop (:meth:`Failover.exclude`) and release its session in the
        background (never waiting on it)."""
        touched = self._touched.get(exc.node_id)
        ticket = touched[1] if touched is not None else next(
            (s.ticket for s in self.states if s.hop.node_id == exc.node_id), None)
        if self.fo.exclude(exc, ticket):
            touched = self._touched.pop(exc.node_id, None)
            if touched is not None:
                self.fo.release([touched], self.session_id, abandoned=True)

    async def _replay(self, old: HopState, new_states: list[HopState]) -> None:
        """Send ``old``'s history through ``new_states`` as prefill chunks (:func:`rechunk`)."""
        async for position, frame, seq_len in rechunk(old.history, self.codec, self.replay_chunk_tokens):
            for state in new_states:
                frame, _ = await self._send(state, frame, position, seq_len, False)

    async def _replace(self, old: HopState, exc: HopFailed) -> None:
        """Swap ``old`` for a new sub-route over its layers, replaying its history as prefill chunks
        (a replacement that fails during the replay is itself excluded and replaced).

        Raises:
            HopBusy, HopFailed: no replacement left (naming the first hop that failed).
        """
        self._exclude(exc)
        for _ in range(self.max_failovers):
            route = await self.fo.new_route(old.hop.layers, exc)
            new_states = [self._new_state(h, route.ticket) for h in route.hops]
            try:
                await self._replay(old, new_states)
            except HopFailed as replay_exc:
                log.warning("%s during replay; failing over", replay_exc.message)
                self._exclude(replay_exc)  # the others stay touched: released at the end
                continue
            index = self.states.index(old)
            self.states[index:index + 1] = new_states
            self.fo.replaced(old.hop, [s.hop for s in new_states], exc.message)
            async with self._turn:
                self._turn.notify_all()
            return
        raise HopFailed(f"{exc.message}; {self.max_failovers} replacements for layers {old.hop.layers} failed",
                        node_id=exc.node_id)

    async def forward(self, hidden: Activation, position: int, *, last_only: bool, rewind: bool = False) -> Activation:
        """Run ``hidden`` ``[1, seq, hidden]`` at ``position`` through every remote hop in order.

        With ``last_only`` the final hop returns only the last position ``[1, 1, hidden]``. With
        ``rewind`` (a speculative step, ADR-0058; the previous step has returned) ``position`` may be
        below what the hops hold: the positions from it on are forgotten, here (each hop's
        history, :func:`cut_history`) and on the hops (:data:`HEADER_REWIND`).

        Raises:
            HopBusy, HopFailed: see :meth:`run_stage`.
        """
        shape = self.codec.shape(hidden)
        self.hidden_size = shape[-1]
        frame = await self.codec.encode(hidden)
        if rewind:
            for state in self.states:
                if state.order.length > position:
                    state.history = await cut_history(state.history, position, self.codec)
                    state.order.length = position
        layer, out = self.start_layer, hidden
        while layer < self.end_layer:
            frame, out, layer = await self.run_stage(layer, frame, position, shape[1], last_only, rewind)
        return out

    def audit_record(self) -> ChainRecord:
        """What an audit of this session needs (ADR-0067): every remote hop's steps and receipts as
        this entry sent and received them over HTTP (its record is the hop's transcript: nothing to
        fetch), the frames sent to each, and each hop's ticket. Only a :attr:`recording` session
        has steps."""
        hops = tuple(s.hop for s in self.states)
        receipts = tuple((index, step.position, step.flags, _receipt_bytes(r))
                         for index, s in enumerate(self.states) for step, r in zip(s.steps, s.receipts))
        sent_to = tuple(tuple((step.position, digest(step.frame_in)) for step in s.steps) for s in self.states)
        return ChainRecord(self.model, self.session_id, "", self.states[0].ticket if self.states else None, hops,
                           sent_to[0] if sent_to else (), tuple(r for r in receipts if r[3]),
                           transcripts=tuple(list(s.steps) for s in self.states), sent_to=sent_to,
                           hop_tickets=tuple(s.ticket for s in self.states))

    def forget(self) -> None:
        """Nothing to forget (a chain stops taking messages here; HTTP calls have all returned)."""

    def close(self, linger: bool = False) -> None:
        """Release the session on every hop it reached, in the background (returns at once,
        never raises; safe to call while the generation is being cancelled). ``linger`` is the
        chain's (its hops' last receipts may be on their way); every call here has returned."""
        touched, self._touched = list(self._touched.values()), {}
        self.fo.release(touched, self.session_id, abandoned=False)


def _receipt_bytes(header: str) -> bytes:
    """The RECEIPT body of an ``X-Meshnet-Receipt`` header value (b"" when missing or unreadable)."""
    try:
        return unb64url(header) if header else b""
    except ValueError:
        return b""
