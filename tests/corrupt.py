"""Test-only: make a node a dishonest holder, to prove that admission and spot-checks catch it.

Never part of the product: service tests call :meth:`Corruption.on_hop_call` on a runtime, and
integration tests start a dishonest node process with ``python -m tests.corrupt node start ...``
(:func:`main`: ``meshnet`` itself, with every ``POST /v1/forward`` hop call counted and the
corruption applied). The environment says where and when:

    MESHNET_TEST_CORRUPT_LAYER=L      add noise to layer L's MLP down-projection (absolute index)
    MESHNET_TEST_CORRUPT_AFTER=N      ... from the (N+1)-th hop call on (default 0: from the first);
                                      N=1 passes one admission challenge, then turns bad
    MESHNET_TEST_CORRUPT_SCALE=S      noise std relative to that weight's std (default 0.5)
    MESHNET_TEST_CORRUPT_DECODE=S     instead: lie only on decode steps (one token past position 0, on
                                      hop streams and hop calls alike): add seeded noise of S x the
                                      output's std to the hop's output; prefill, admission challenges
                                      and spot-checks (position 0) stay honest
    MESHNET_TEST_CORRUPT_DECODE_WEIGHTS=S  instead: on decode steps only, run with noise of S x the
                                      weight's std on layer MESHNET_TEST_CORRUPT_LAYER's MLP
                                      down-projection (the honest weights back for every other step;
                                      for one request at a time: a step batched with another
                                      session's would share the swap)
    MESHNET_TEST_CORRUPT_STREAMS_WEIGHTS=S  instead: on every step that comes over a hop stream
                                      (prefill and decode), the same noise on the same weights;
                                      honest on ``POST /v1/forward`` (admission challenges,
                                      spot-checks, witness replays, the HTTP hop path)
    MESHNET_TEST_CORRUPT_REPLAYS_WEIGHTS=S  instead: the same noise on the same weights only on an
                                      entry's ``POST /v1/forward`` calls that return every position
                                      (an audit's witness replay) from an entry whose id starts with
                                      MESHNET_TEST_LIE_TO (default ``entry``); honest on hop streams
                                      and on every other call (the tracker's challenges and audit
                                      re-runs): a witness that lies to an entry to frame honest holders
    MESHNET_TEST_WITHHOLD_TRANSCRIPTS=1  also answer every transcript request 404 (keeps none)
    MESHNET_TEST_CLAIM_SPEED=K        claim K times the measured decode speed in doctor reports and in
                                      heartbeats (routes prefer the fastest holder: the dishonest node
                                      draws the traffic, unless the tracker's speed probes refute it)
    MESHNET_TEST_SLOW_S=S             be slower than the host: wait S seconds before every forward pass
                                      of a hop (streams, hop calls, probes alike; the doctor's own
                                      measurement, and so the claim, is not slowed)

The noise is seeded (0) and added in place to the loaded weights; the capability report and
its weights digest stay those of the honest load (a dishonest node would lie about them too).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshnet.models.linears import dense_weight, set_weight

log = logging.getLogger(__name__)


@dataclass
class Corruption:
    """When and where to corrupt; ``calls`` counts hop calls seen, ``done`` once applied."""

    layer: int
    after_calls: int = 0
    scale: float = 0.5
    calls: int = 0
    done: bool = False

    @classmethod
    def from_env(cls) -> "Corruption | None":
        """The corruption the environment asks for, or None (the normal case)."""
        layer = os.environ.get("MESHNET_TEST_CORRUPT_LAYER")
        if not layer:
            return None
        return cls(int(layer), int(os.environ.get("MESHNET_TEST_CORRUPT_AFTER", "0")),
                   float(os.environ.get("MESHNET_TEST_CORRUPT_SCALE", "0.5")))

    def on_hop_call(self, runtime) -> None:
        """Count one hop call; corrupt every loaded shard holding ``layer`` once the count passes
        ``after_calls`` (call before the forward runs)."""
        self.calls += 1
        if self.done or self.calls <= self.after_calls:
            return
        for slot in list(runtime.slots.values()):
            block = slot.shard.blocks[str(self.layer)] if str(self.layer) in slot.shard.blocks else None
            if block is None:
                continue
            weight = dense_weight(block.mlp.down_proj)
            with torch.no_grad(), runtime.lock:
                gen = torch.Generator().manual_seed(0)
                noise = torch.randn(weight.shape, generator=gen) * float(weight.float().std()) * self.scale
                set_weight(block.mlp.down_proj, weight + noise.to(weight.dtype))
            log.warning("TEST: corrupted layer %d of %s (noise %.2f x std) after %d hop call(s)", self.layer,
                        slot.key, self.scale, self.after_calls)
            self.done = True


def lie_on_decode(scale: float) -> None:
    """Make every decode step of this process's hops (one token past position 0) return its output
    plus seeded noise of ``scale`` x the output's std (the node's one lie)."""
    from meshnet.node.runtime import NodeRuntime

    honest = NodeRuntime.forward_async
    gen = torch.Generator().manual_seed(0)

    async def forward_async(self, *, position, hidden, **kw):
        out = await honest(self, position=position, hidden=hidden, **kw)
        if position > 0 and hidden.shape[1] == 1:
            noise = torch.randn(out.shape, generator=gen) * float(out.float().std()) * scale
            out = out + noise.to(out.dtype)
        return out

    NodeRuntime.forward_async = forward_async
    log.warning("TEST: lying on decode steps (noise %.2f x the output's std)", scale)


def lie_on_decode_weights(layer: int, scale: float) -> None:
    """Make every decode step of this process's hops (one token past position 0) run with seeded
    noise of ``scale`` x the weight's std on ``layer``'s MLP down-projection; every other step
    (prefill, admission challenges, spot-checks, audit re-runs) with the honest weights."""
    _lie_with_weights(layer, scale, lambda position, hidden: position > 0 and hidden.shape[1] == 1)
    log.warning("TEST: lying on decode steps (noise %.2f x std on layer %d's weights)", scale, layer)


def lie_on_stream_weights(layer: int, scale: float) -> None:
    """Make this process's hops hold weights with the noise of :func:`lie_on_decode_weights` for
    every step that comes over a hop stream (prefill and decode), and the honest ones while any
    ``POST /v1/forward`` is in flight (admission challenges, spot-checks, witness replays): the
    node lies only where it thinks no one checks. A stream step that runs beside such a call runs
    honestly too (the lie is never larger than stated)."""
    import meshnet.node.app as node_app

    honest_forward, in_flight = node_app.forward, [0]

    def use(runtime, noisy: bool) -> None:
        with torch.no_grad():
            for module, honest, lie in _weight_pairs(runtime, layer, scale):
                set_weight(module, lie if noisy else honest)

    async def forward(request):
        runtime = request.app.state.node.runtime
        in_flight[0] += 1
        if in_flight[0] == 1:
            use(runtime, noisy=False)
        try:
            return await honest_forward(request)
        finally:
            in_flight[0] -= 1
            if in_flight[0] == 0:
                use(runtime, noisy=True)  # back to the lie

    node_app.forward = forward  # build_app routes /v1/forward to this module attribute
    from meshnet.node.runtime import NodeRuntime

    honest_forward_async, lying = NodeRuntime.forward_async, set()  # lying: id() of runtimes with the lie in

    async def forward_async(self, **kw):  # the first step after loading puts the lie in place
        if id(self) not in lying and in_flight[0] == 0:
            lying.add(id(self))
            use(self, noisy=True)
        return await honest_forward_async(self, **kw)

    NodeRuntime.forward_async = forward_async
    log.warning("TEST: lying on hop streams (noise %.2f x std on layer %d's weights)", scale, layer)


def lie_on_replay_weights(layer: int, scale: float) -> None:
    """Make this process's ``POST /v1/forward`` calls that ask for every position from an entry whose
    id starts with ``$MESHNET_TEST_LIE_TO`` (default ``entry``; an audit's witness replay for it)
    run with :func:`_weight_pairs`' noisy weights, every other step with the honest ones: the node
    lies to that entry when it witnesses for it, so that its audits accuse the honest node they
    audit. (The tracker's own calls name an entry as a node's would, ADR-0070: a liar cannot single
    them out; this one is told whom to lie to.)"""
    import json

    import meshnet.node.app as node_app
    from meshnet.protocol.signing import unb64url
    from meshnet.protocol.tickets import HEADER_TICKET

    honest_forward = node_app.forward
    target = os.environ.get("MESHNET_TEST_LIE_TO", "entry")

    def entry_of(request) -> str:
        try:
            return json.loads(unb64url(request.headers.get(HEADER_TICKET, "").split(".")[0]))["entry"]
        except (ValueError, KeyError, TypeError):
            return ""

    async def forward(request):
        if request.headers.get("X-Meshnet-Last-Only") == "1" or not entry_of(request).startswith(target):
            return await honest_forward(request)
        pairs = _weight_pairs(request.app.state.node.runtime, layer, scale)
        with torch.no_grad():
            for module, _, noisy in pairs:
                set_weight(module, noisy)
        try:
            return await honest_forward(request)
        finally:
            with torch.no_grad():
                for module, honest, _ in pairs:
                    set_weight(module, honest)

    node_app.forward = forward  # build_app routes /v1/forward to this module attribute
    log.warning("TEST: lying on entries' witness replays (noise %.2f x std on layer %d's weights)", scale, layer)


def _weight_pairs(runtime, layer: int, scale: float) -> list:
    """[(module, honest weight, noisy weight)] of ``layer``'s MLP down-projection in each of
    ``runtime``'s shards, the noise seeded (0) and ``scale`` x the weight's std (made once)."""
    if id(runtime) not in _PAIRS:
        found = []
        for slot in list(runtime.slots.values()):
            if str(layer) in slot.shard.blocks:
                module = slot.shard.blocks[str(layer)].mlp.down_proj
                honest = dense_weight(module).detach().clone()
                gen = torch.Generator().manual_seed(0)
                noise = torch.randn(honest.shape, generator=gen) * float(honest.float().std()) * scale
                found.append((module, honest, (honest.float() + noise).to(honest.dtype)))
        _PAIRS[id(runtime)] = found
    return _PAIRS[id(runtime)]


#: id(runtime) -> :func:`_weight_pairs`' answer
_PAIRS: dict[int, list] = {}


def _lie_with_weights(layer: int, scale: float, lies: Callable[[int, torch.Tensor], bool]) -> None:
    """Run each forward pass of this process's hops for which ``lies(position, hidden)`` holds with
    :func:`_weight_pairs`' noisy weights, the honest ones back afterwards (for one request at a
    time: a pass that runs beside a lying one, of another session, shares the swap)."""
    from meshnet.node.runtime import NodeRuntime

    honest_forward = NodeRuntime.forward_async

    async def forward_async(self, *, position, hidden, **kw):
        if not lies(position, hidden):
            return await honest_forward(self, position=position, hidden=hidden, **kw)
        pairs = _weight_pairs(self, layer, scale)
        with torch.no_grad():
            for module, _, noisy in pairs:
                set_weight(module, noisy)
        try:
            return await honest_forward(self, position=position, hidden=hidden, **kw)
        finally:
            with torch.no_grad():
                for module, honest, _ in pairs:
                    set_weight(module, honest)

    NodeRuntime.forward_async = forward_async


def withhold_transcripts() -> None:
    """Make this process answer every transcript request (``GET /v1/transcripts/{id}``, an entry's
    audit) 404, as if it kept none: a liar hoping that an audit without its transcript proves nothing."""
    import meshnet.node.app as node_app
    from meshnet.errors import NotFound

    async def transcript(request):
        raise NotFound("no transcript of that chain is kept here for that key", code="no_transcript")

    node_app.transcript = transcript  # build_app routes /v1/transcripts/{id} to this module attribute
    log.warning("TEST: withholding every transcript")


def _slow_down(seconds: float) -> None:
    """Wait ``seconds`` before each of this process's hop forward passes (a slower host)."""
    import asyncio

    from meshnet.node.runtime import NodeRuntime

    honest_forward = NodeRuntime.forward_async

    async def forward_async(self, **kw):
        await asyncio.sleep(seconds)
        return await honest_forward(self, **kw)

    NodeRuntime.forward_async = forward_async
    log.warning("TEST: %.3f s slower on every forward pass", seconds)


def main() -> None:
    """``meshnet`` with :class:`Corruption` from the environment installed on the node's hop calls
    (``POST /v1/forward``: admission challenges, spot-checks and the HTTP hop path), or lying on
    decode steps only (``MESHNET_TEST_CORRUPT_DECODE``)."""
    import meshnet.node.app as node_app
    from meshnet.cli.main import app

    if os.environ.get("MESHNET_TEST_CORRUPT_DECODE"):
        lie_on_decode(float(os.environ["MESHNET_TEST_CORRUPT_DECODE"]))
    if os.environ.get("MESHNET_TEST_CORRUPT_DECODE_WEIGHTS"):
        lie_on_decode_weights(int(os.environ["MESHNET_TEST_CORRUPT_LAYER"]),
                              float(os.environ["MESHNET_TEST_CORRUPT_DECODE_WEIGHTS"]))
    if os.environ.get("MESHNET_TEST_CORRUPT_STREAMS_WEIGHTS"):
        lie_on_stream_weights(int(os.environ["MESHNET_TEST_CORRUPT_LAYER"]),
                              float(os.environ["MESHNET_TEST_CORRUPT_STREAMS_WEIGHTS"]))
    if os.environ.get("MESHNET_TEST_CORRUPT_REPLAYS_WEIGHTS"):
        lie_on_replay_weights(int(os.environ["MESHNET_TEST_CORRUPT_LAYER"]),
                              float(os.environ["MESHNET_TEST_CORRUPT_REPLAYS_WEIGHTS"]))
    if os.environ.get("MESHNET_TEST_WITHHOLD_TRANSCRIPTS"):
        withhold_transcripts()
    if os.environ.get("MESHNET_TEST_CLAIM_SPEED"):
        import meshnet.node.doctor as doctor
        from meshnet.node.metrics import NodeMetrics

        measured, factor = doctor.measure_decode_tokens_per_s, float(os.environ["MESHNET_TEST_CLAIM_SPEED"])
        doctor.measure_decode_tokens_per_s = lambda *a, **kw: measured(*a, **kw) * factor
        honest_stats = NodeMetrics.heartbeat_stats

        def heartbeat_stats(self, *args, **kw):  # the figure heartbeats carry once it has served
            stats = honest_stats(self, *args, **kw)
            return stats.model_copy(update={"tokens_per_s": stats.tokens_per_s * factor})

        NodeMetrics.heartbeat_stats = heartbeat_stats

    if os.environ.get("MESHNET_TEST_SLOW_S"):
        _slow_down(float(os.environ["MESHNET_TEST_SLOW_S"]))

    weights_lie = any(os.environ.get(f"MESHNET_TEST_CORRUPT_{kind}_WEIGHTS") for kind in ("DECODE", "STREAMS", "REPLAYS"))
    corruption = None if weights_lie else Corruption.from_env()
    if corruption is not None:
        honest = node_app.forward

        async def forward(request):
            corruption.on_hop_call(request.app.state.node.runtime)
            return await honest(request)

        node_app.forward = forward  # build_app routes /v1/forward to this module attribute
    sys.argv[0] = "meshnet"
    app()


if __name__ == "__main__":
    main()
