"""Remote hops of one session: forward calls, input history, failover by replay.

Each hop keeps every input frame it was sent (with its position) for the life of the
session. When a hop fails or times out, the orchestrator reports it, asks for a new
route over the same layers without the failed node, replays the history to the
replacement (in the same chunks, so the replacement's KV cache is identical), and goes on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx
import torch

from meshnet import wire
from meshnet.errors import HopFailed, MeshnetError
from meshnet.layers import LayerRange
from meshnet.protocol.route import Hop

log = logging.getLogger(__name__)


#: async (model, layers, exclude node ids) -> hops covering exactly ``layers``
RouteProvider = Callable[[str, LayerRange, frozenset[str]], Awaitable[list[Hop]]]
#: async (node id, reason) -> None; tells the tracker a hop failed
FailureReporter = Callable[[str, str], Awaitable[None]]


@dataclass
class HopState:
    """A hop plus what it has been sent: ``history`` of ``(position, frame)``, ``length`` tokens."""

    hop: Hop
    history: list[tuple[int, bytes]] = field(default_factory=list)
    length: int = 0


async def post_forward(client: httpx.AsyncClient, hop: Hop, *, model: str, session_id: str, position: int,
                       frame: bytes, last_only: bool, timeout_s: float) -> bytes:
    """``POST {endpoint}/v1/forward`` with one activation frame; returns the output frame.

    Raises:
        HopFailed: transport error, timeout, or a non-200 answer.
    """
    start, end = hop.layers.to_inclusive()
    headers = {"X-Meshnet-Model": model, "X-Meshnet-Session": session_id, "X-Meshnet-Start-Layer": str(start),
               "X-Meshnet-End-Layer": str(end), "X-Meshnet-Position": str(position),
               "Content-Type": "application/octet-stream"}
    if last_only:
        headers["X-Meshnet-Last-Only"] = "1"
    try:
        resp = await client.post(f"{hop.endpoint}/v1/forward", content=frame, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise HopFailed(f"hop {hop.node_id} ({hop.layers}) failed: {type(exc).__name__}: {exc}",
                        node_id=hop.node_id) from exc
    if resp.status_code != 200:
        raise HopFailed(f"hop {hop.node_id} ({hop.layers}) answered {resp.status_code}: {resp.text[:200]}",
                        node_id=hop.node_id)
    return resp.content


class RemoteRoute:
    """The remote part of one session's route, with failover.

    Args:
        client: shared httpx client.
        model: model id sent in ``X-Meshnet-Model``.
        session_id: id of the generation (``X-Meshnet-Session``).
        hops: initial hops, in layer order.
        routes: provider of replacement hops; ``report``: failure reporter.
        wire_dtype: ``bfloat16`` (default) or ``float32``.
        timeout_s: per hop call.
        max_failovers: replacements per hop call before giving up.
    """

    def __init__(self, client: httpx.AsyncClient, *, model: str, session_id: str, hops: list[Hop],
                 routes: RouteProvider, report: FailureReporter, wire_dtype: str = "bfloat16",
                 timeout_s: float = 60.0, max_failovers: int = 3) -> None:
        self.client, self.model, self.session_id = client, model, session_id
        self.states = [HopState(h) for h in hops]
        self.routes, self.report = routes, report
        self.wire_dtype, self.timeout_s, self.max_failovers = wire_dtype, timeout_s, max_failovers
        self.failed: set[str] = set()
        self.failovers = 0
        self.start_layer = hops[0].layers.start if hops else 0
        self.end_layer = hops[-1].layers.end if hops else 0
        self._turn = asyncio.Condition()

    @property
    def hops(self) -> list[Hop]:
        return [s.hop for s in self.states]

    def _state_at(self, layer: int) -> HopState:
        return next(s for s in self.states if s.hop.layers.start == layer)

    async def _send(self, state: HopState, frame: bytes, position: int, seq_len: int, last_only: bool) -> bytes:
        out = await post_forward(self.client, state.hop, model=self.model, session_id=self.session_id,
                                 position=position, frame=frame, last_only=last_only, timeout_s=self.timeout_s)
        state.history.append((position, frame))
        state.length = position + seq_len
        return out

    async def run_stage(self, layer: int, frame: bytes, position: int, seq_len: int, last_only: bool) -> tuple[bytes, int]:
        """Send ``frame`` (``seq_len`` tokens at ``position``) through the hop starting at ``layer``.

        Waits until that hop has received every earlier position (chunks stay in order even
        when prefill is pipelined); on failure replaces the hop and retries.

        Returns:
            ``(output frame, next layer)``.

        Raises:
            HopFailed: ``max_failovers`` replacements all failed.
        """
        for _ in range(self.max_failovers + 1):
            async with self._turn:
                await self._turn.wait_for(lambda: self._state_at(layer).length == position)
                state = self._state_at(layer)
            is_final = state.hop.layers.end == self.end_layer
            try:
                out = await self._send(state, frame, position, seq_len, last_only and is_final)
                async with self._turn:
                    self._turn.notify_all()
                return out, state.hop.layers.end
            except HopFailed as exc:
                log.warning("%s; failing over", exc.message)
                await self._replace(state, exc.message)
        raise HopFailed(f"hop at layer {layer} failed {self.max_failovers + 1} times")

    async def _replace(self, old: HopState, reason: str) -> None:
        self.failed.add(old.hop.node_id)
        await self.report(old.hop.node_id, reason)
        try:
            new_hops = await self.routes(self.model, old.hop.layers, frozenset(self.failed))
        except MeshnetError as exc:
            raise HopFailed(f"no replacement for layers {old.hop.layers}: {exc.message}",
                            node_id=old.hop.node_id) from exc
        self.failovers += 1
        new_states = [HopState(h) for h in new_hops]
        for position, frame in old.history:  # replay chunk by chunk through the new sub-route
            seq_len = wire.decode(frame, check_finite=False).shape[1]
            for state in new_states:
                frame = await self._send(state, frame, position, seq_len, False)
        index = self.states.index(old)
        self.states[index:index + 1] = new_states
        async with self._turn:
            self._turn.notify_all()

    async def forward(self, hidden: torch.Tensor, position: int, *, last_only: bool) -> torch.Tensor:
        """Run ``hidden`` ``[1, seq, hidden]`` at ``position`` through every remote hop in order.

        With ``last_only`` the final hop returns only the last position ``[1, 1, hidden]``.
        """
        frame = await wire.encode_async(hidden, dtype=self.wire_dtype)
        layer = self.start_layer
        while layer < self.end_layer:
            frame, layer = await self.run_stage(layer, frame, position, hidden.shape[1], last_only)
        return await wire.decode_async(frame)

    async def close(self) -> None:
        """Release the session on every hop (best effort)."""
        for state in self.states:
            try:
                await self.client.delete(f"{state.hop.endpoint}/v1/sessions/{self.session_id}", timeout=5.0)
            except httpx.HTTPError:
                pass
