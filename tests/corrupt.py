"""Test-only: make a node a dishonest holder, to prove that admission and spot-checks catch it.

Never part of the product: service tests call :meth:`Corruption.on_hop_call` on a runtime, and
integration tests start a dishonest node process with ``python -m tests.corrupt node start ...``
(:func:`main`: ``meshnet`` itself, with every ``POST /v1/forward`` hop call counted and the
corruption applied). The environment says where and when:

    MESHNET_TEST_CORRUPT_LAYER=L      add noise to layer L's MLP down-projection (absolute index)
    MESHNET_TEST_CORRUPT_AFTER=N      ... from the (N+1)-th hop call on (default 0: from the first);
                                      N=1 passes one admission challenge, then turns bad
    MESHNET_TEST_CORRUPT_SCALE=S      noise std relative to that weight's std (default 0.5)

The noise is seeded (0) and added in place to the loaded weights; the capability report and
its weights digest stay those of the honest load (a dishonest node would lie about them too).
"""

from __future__ import annotations

import logging
import os
import sys
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


def main() -> None:
    """``meshnet`` with :class:`Corruption` from the environment installed on the node's hop calls
    (``POST /v1/forward``: admission challenges, spot-checks and the HTTP hop path)."""
    import meshnet.node.app as node_app
    from meshnet.cli.main import app

    corruption = Corruption.from_env()
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
