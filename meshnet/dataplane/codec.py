"""The codec interface: activations to and from the frames hops exchange, torch-free.

The data plane moves activations it never looks into: an :data:`Activation` is whatever the
node computes with (a torch tensor there), and an :class:`ActivationCodec` turns it into a
frame (:mod:`meshnet.dataplane.frames`) and back. The node implements it
(:class:`meshnet.node.entry.WireCodec`, over :mod:`meshnet.node.wire`); tests may use a fake.
"""

from __future__ import annotations

from typing import Any, Protocol

#: hidden states ``[1, seq, hidden]`` as the entry node holds them; opaque to the gateway
Activation = Any


class ActivationCodec(Protocol):
    """Activations to and from the wire frames hops exchange (ADR-0001)."""

    async def encode(self, hidden: Activation) -> bytes:
        """One frame of ``hidden`` in the session's wire dtype."""

    async def decode(self, frame: bytes) -> Activation:
        """The activation a frame holds.

        Raises:
            meshnet.errors.WireError: a malformed frame.
        """

    def shape(self, hidden: Activation) -> tuple[int, ...]:
        """``(batch, seq, hidden)`` of an activation."""

    def last(self, hidden: Activation) -> Activation:
        """The last position only: ``[1, 1, hidden]``."""

    def concat(self, parts: list[Activation]) -> Activation:
        """``parts`` ``[1, seq_i, hidden]`` joined along the sequence: ``[1, sum(seq_i), hidden]``."""

    def split(self, hidden: Activation, tokens: int) -> list[Activation]:
        """``hidden`` cut along the sequence into pieces of ``tokens`` positions (the last may be
        shorter), in order."""
