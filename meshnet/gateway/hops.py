"""Remote hops of one session: forward calls, input history, failover by replay.

Each hop keeps every input frame it was sent (with its position) for the life of the
session. When a hop fails or times out, the orchestrator reports it, asks for a new
route over the same layers without the failed node, replays the history to the
replacement (in the same chunks, so the replacement's KV cache is identical), and goes on.

Every error on a hop call is that hop's failure (:class:`HopFailed`): a refused or slow
connection, an unusable URL, a non-200 answer, a reply frame that does not decode or has
the wrong shape. A hop that answers 503 (session cache full, draining) is *busy*
(:class:`HopBusy`): it is replaced the same way but not reported to the tracker, since
it is healthy. A hop that answers 409 ``session_conflict`` lost the session (expired or
restarted): it is neither reported nor excluded, so the replay may restart the session
on it. When no replacement exists the error names the hop and its layers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx

from meshnet.errors import HopBusy, HopFailed, MeshnetError
from meshnet.gateway.entry import Activation, ActivationCodec
from meshnet.layers import LayerRange
from meshnet.protocol.route import Hop

log = logging.getLogger(__name__)


#: async (model, layers, exclude node ids) -> hops covering exactly ``layers``
RouteProvider = Callable[[str, LayerRange, frozenset[str]], Awaitable[list[Hop]]]
#: async (node id, reason) -> None; tells the tracker a hop failed
FailureReporter = Callable[[str, str], Awaitable[None]]


#: a hop's 409 code: it no longer holds the session (expired, released, restarted) but is healthy
LOST_SESSION = "session_conflict"


@dataclass
class HopState:
    """A hop plus what it has been sent: ``history`` of ``(position, frame, tokens)``, ``length`` tokens."""

    hop: Hop
    history: list[tuple[int, bytes, int]] = field(default_factory=list)
    length: int = 0


def _describe(hop: Hop) -> str:
    return f"hop {hop.node_id} at {hop.endpoint} (layers {hop.layers})"


def _error_of(resp: httpx.Response) -> tuple[str, str]:
    """``(code, message)`` of an error answer (the OpenAI envelope when there is one)."""
    try:
        err = resp.json().get("error") or {}
        return str(err.get("code") or "http_error"), str(err.get("message") or resp.text[:200])
    except (ValueError, AttributeError):
        return "http_error", resp.text[:200]


async def post_forward(client: httpx.AsyncClient, hop: Hop, *, model: str, session_id: str, position: int,
                       frame: bytes, last_only: bool, timeout: httpx.Timeout | float,
                       codec: ActivationCodec, expect_shape: tuple[int, ...] | None = None,
                       ) -> tuple[bytes, Activation]:
    """``POST {endpoint}/v1/forward`` with one activation frame.

    Args:
        timeout: the whole call (seconds) or an ``httpx.Timeout`` with its own connect limit.
        expect_shape: the output shape the reply must have (None: any).

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
    try:
        resp = await client.post(f"{hop.endpoint}/v1/forward", content=frame, headers=headers, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - InvalidURL, StreamError, OSError...: all this hop's failure
        raise HopFailed(f"{_describe(hop)} failed: {type(exc).__name__}: {exc}", node_id=hop.node_id) from exc
    if resp.status_code == 503:
        code, message = _error_of(resp)
        raise HopBusy(f"{_describe(hop)} refused the session ({code}): {message}", node_id=hop.node_id, code=code)
    if resp.status_code != 200:
        code, message = _error_of(resp)
        raise HopFailed(f"{_describe(hop)} answered {resp.status_code} ({code}): {message}", node_id=hop.node_id,
                        code=code if code == LOST_SESSION else None)
    try:
        out = await codec.decode(resp.content)
    except MeshnetError as exc:
        raise HopFailed(f"{_describe(hop)} sent a bad activation frame: {exc.message}", node_id=hop.node_id) from exc
    if expect_shape is not None and codec.shape(out) != tuple(expect_shape):
        raise HopFailed(f"{_describe(hop)} sent shape {list(codec.shape(out))}, expected {list(expect_shape)}",
                        node_id=hop.node_id)
    return resp.content, out


class RemoteRoute:
    """The remote part of one session's route, with failover.

    Args:
        client: shared httpx client.
        model: model id sent in ``X-Meshnet-Model``.
        session_id: id of the generation (``X-Meshnet-Session``).
        hops: initial hops, in layer order.
        routes: provider of replacement hops; ``report``: failure reporter.
        codec: activations to and from frames (the entry node's :class:`ActivationCodec`).
        timeout_s: per hop call, seconds; ``connect_timeout_s``: to connect to a hop, seconds.
        max_failovers: replacements per hop call before giving up.
    """

    def __init__(self, client: httpx.AsyncClient, *, model: str, session_id: str, hops: list[Hop],
                 routes: RouteProvider, report: FailureReporter, codec: ActivationCodec,
                 timeout_s: float = 60.0, connect_timeout_s: float = 5.0, max_failovers: int = 3) -> None:
        self.client, self.model, self.session_id = client, model, session_id
        self.states = [HopState(h) for h in hops]
        self.routes, self.report = routes, report
        self.codec, self.max_failovers = codec, max_failovers
        self.timeout = httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s))
        self.failed: set[str] = set()   # nodes excluded from this session's routes (failed or busy)
        self.failovers = 0
        self.start_layer = hops[0].layers.start if hops else 0
        self.end_layer = hops[-1].layers.end if hops else 0
        self.hidden_size: int | None = None
        self._turn = asyncio.Condition()

    @property
    def hops(self) -> list[Hop]:
        return [s.hop for s in self.states]

    def _state_at(self, layer: int) -> HopState:
        return next(s for s in self.states if s.hop.layers.start == layer)

    async def _send(self, state: HopState, frame: bytes, position: int, seq_len: int,
                    last_only: bool) -> tuple[bytes, Activation]:
        shape = None if self.hidden_size is None else (1, 1 if last_only else seq_len, self.hidden_size)
        out = await post_forward(self.client, state.hop, model=self.model, session_id=self.session_id,
                                 position=position, frame=frame, last_only=last_only, timeout=self.timeout,
                                 codec=self.codec, expect_shape=shape)
        state.history.append((position, frame, seq_len))
        state.length = position + seq_len
        return out

    async def run_stage(self, layer: int, frame: bytes, position: int, seq_len: int,
                        last_only: bool) -> tuple[bytes, Activation, int]:
        """Send ``frame`` (``seq_len`` tokens at ``position``) through the hop starting at ``layer``.

        Waits until that hop has received every earlier position (chunks stay in order even
        when prefill is pipelined); on failure replaces the hop and retries.

        Returns:
            ``(output frame, output tensor, next layer)``.

        Raises:
            HopBusy: the hop is busy and no other node serves its layers (503).
            HopFailed: no replacement, or ``max_failovers`` replacements all failed (502).
        """
        last: HopFailed | None = None
        for _ in range(self.max_failovers + 1):
            async with self._turn:
                await self._turn.wait_for(lambda: self._state_at(layer).length == position)
                state = self._state_at(layer)
            is_final = state.hop.layers.end == self.end_layer
            try:
                out, tensor = await self._send(state, frame, position, seq_len, last_only and is_final)
                async with self._turn:
                    self._turn.notify_all()
                return out, tensor, state.hop.layers.end
            except HopFailed as exc:
                log.warning("%s; failing over", exc.message)
                last = exc
                await self._replace(state, exc)
        raise HopFailed(f"the hops from layer {layer} failed {self.max_failovers + 1} times; last: {last.message}",
                        node_id=last.node_id)

    async def _exclude(self, exc: HopFailed) -> None:
        """Keep the hop's node out of this session's routes; report it unless it was only busy.
        A hop that lost the session stays eligible: the replay restarts the session on it."""
        if exc.node_id is None or exc.code == LOST_SESSION:
            return
        self.failed.add(exc.node_id)
        if isinstance(exc, HopBusy):
            return
        try:
            await self.report(exc.node_id, exc.message)
        except Exception:  # noqa: BLE001 - a lost report must not fail the generation
            log.warning("could not report the failure of %s", exc.node_id, exc_info=True)

    async def _new_hops(self, layers: LayerRange, exc: HopFailed) -> list[Hop]:
        try:
            return await self.routes(self.model, layers, frozenset(self.failed))
        except Exception as route_exc:  # noqa: BLE001 - no route, tracker down, bad answer
            why = getattr(route_exc, "message", None) or f"{type(route_exc).__name__}: {route_exc}"
            cls = HopBusy if isinstance(exc, HopBusy) else HopFailed
            raise cls(f"{exc.message}; no other node serves layers {layers}: {why}", node_id=exc.node_id,
                      code=exc.code) from route_exc

    async def _replace(self, old: HopState, exc: HopFailed) -> None:
        """Swap ``old`` for a new sub-route over its layers, replaying its history chunk by chunk
        (a replacement that fails during the replay is itself excluded and replaced).

        Raises:
            HopBusy, HopFailed: no replacement left (naming the first hop that failed).
        """
        await self._exclude(exc)
        for _ in range(self.max_failovers):
            new_states = [HopState(h) for h in await self._new_hops(old.hop.layers, exc)]
            try:
                for position, frame, seq_len in old.history:  # same chunks: the same KV cache
                    for state in new_states:
                        frame, _ = await self._send(state, frame, position, seq_len, False)
            except HopFailed as replay_exc:
                log.warning("%s during replay; failing over", replay_exc.message)
                await self._exclude(replay_exc)
                await self._release(new_states)
                continue
            self.failovers += 1
            index = self.states.index(old)
            self.states[index:index + 1] = new_states
            async with self._turn:
                self._turn.notify_all()
            return
        raise HopFailed(f"{exc.message}; {self.max_failovers} replacements for layers {old.hop.layers} failed",
                        node_id=exc.node_id)

    async def forward(self, hidden: Activation, position: int, *, last_only: bool) -> Activation:
        """Run ``hidden`` ``[1, seq, hidden]`` at ``position`` through every remote hop in order.

        With ``last_only`` the final hop returns only the last position ``[1, 1, hidden]``.

        Raises:
            HopBusy, HopFailed: see :meth:`run_stage`.
        """
        shape = self.codec.shape(hidden)
        self.hidden_size = shape[-1]
        frame = await self.codec.encode(hidden)
        layer, out = self.start_layer, hidden
        while layer < self.end_layer:
            frame, out, layer = await self.run_stage(layer, frame, position, shape[1], last_only)
        return out

    async def _release(self, states: list[HopState]) -> None:
        for state in states:
            try:
                await self.client.delete(f"{state.hop.endpoint}/v1/sessions/{self.session_id}", timeout=5.0)
            except Exception:  # noqa: BLE001 - best effort: an unreachable hop expires the session by TTL
                pass

    async def close(self) -> None:
        """Release the session on every hop (best effort; never raises)."""
        await self._release(self.states)
