"""Who may attach a tunnel to a relay that keeps no registry of its own (ADR-0045).

The tracker's hub checks attaches against its own key bindings (:mod:`meshnet.tracker.app`); a
node started with ``--offer-relay`` has none, so it asks the tracker for the key bound to the
attaching node id and checks the signature itself (:class:`KeyedAuthorize`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping

from meshnet.errors import Forbidden, NotFound, Unauthorized
from meshnet.protocol.signing import MAX_SKEW_S, decode_public_key, signer_of, verify_request

__all__ = ["KeyedAuthorize"]


class KeyedAuthorize:
    """An :data:`Authorize` for a relay that keeps no registry of its own (a node offering relay):
    the attach must be signed (ADR-0035) by the key ``key_of(node_id)`` returns (the tracker's
    binding, fetched once per node id and kept), fresh, and with a nonce not seen before.

    Raises (when called):
        Unauthorized (401): unsigned, stale, replayed, or not signed by the bound key.
        Forbidden (403): signed as another node than the one attaching.
        NotFound (404): no key is bound to the node id.
    """

    def __init__(self, key_of: Callable[[str], Awaitable[str | None]], max_skew_s: float = MAX_SKEW_S) -> None:
        self.key_of, self.max_skew_s = key_of, max_skew_s
        self._keys: dict[str, str] = {}
        self._seen: dict[tuple[str, str], float] = {}

    async def __call__(self, node_id: str, headers: Mapping[str, str], method: str, target: str) -> None:
        signer = signer_of(headers)
        if signer != node_id:
            raise Forbidden(f"{signer} may not attach a tunnel for node {node_id}", code="not_your_node")
        if node_id not in self._keys:
            key = await self.key_of(node_id)
            if key is None:
                raise NotFound(f"unknown node {node_id!r}: no key is bound to it", code="unknown_node")
            self._keys[node_id] = key
        now = time.time()
        call = verify_request(decode_public_key(self._keys[node_id]), headers, method, target, b"", now=now,
                              max_skew_s=self.max_skew_s)
        self._seen = {k: t for k, t in self._seen.items() if t > now}
        if (call.node_id, call.nonce) in self._seen:
            raise Unauthorized(f"replayed tunnel attach of {node_id} (nonce seen before)", code="replayed")
        self._seen[(call.node_id, call.nonce)] = call.timestamp + self.max_skew_s
