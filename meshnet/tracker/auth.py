"""Who may talk to the tracker as a node (ADR-0035).

- Joining: a registration presents the tracker's join token (``X-Meshnet-Join-Token``) when the
  tracker has one, and is signed by the key it registers (proof that the sender holds it).
- Every later node call (heartbeat, failure report, drain, deregister) is signed by the key
  bound to the node id that signs it (:mod:`meshnet.protocol.signing`); a timestamp further
  than :data:`~meshnet.protocol.signing.MAX_SKEW_S` from the tracker's clock, or a nonce seen
  within that window, is refused.
- Exposure: a tracker listening beyond loopback needs a join token and an operator token
  unless it runs ``--insecure`` on purpose (:func:`exposure_problem`).
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Mapping

from meshnet.errors import Forbidden, InvalidRequest, NotFound, Unauthorized
from meshnet.protocol.control import RegisterRequest
from meshnet.protocol.http import same_secret
from meshnet.protocol.signing import HEADER_JOIN_TOKEN, MAX_SKEW_S, decode_public_key, signer_of, verify_request


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps a service on this machine: ``localhost`` or a loopback
    address (``127.0.0.0/8``, ``::1``). Wildcards (``0.0.0.0``, ``::``) and other names are not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, join_token: str | None, operator_token: str | None, insecure: bool) -> str:
    """Why a tracker must not start listening on ``host`` with these tokens ("" when it may).

    On loopback both tokens are optional; beyond it both are required, unless ``insecure``.
    """
    if insecure or is_loopback(host):
        return ""
    missing = [flag for flag, value in (("--join-token", join_token), ("--operator-token", operator_token))
               if not value]
    if not missing:
        return ""
    return (f"the tracker would listen on {host} (beyond loopback) without {' and '.join(missing)}: anyone who "
            "reaches it could join nodes or steer the mesh. Pass --join-token and --operator-token (or "
            "MESHNET_JOIN_TOKEN / MESHNET_OPERATOR_TOKEN), or --insecure to run it open on purpose")


@functools.lru_cache(maxsize=65536)
def _decoded_key(public_key: str):
    """:func:`decode_public_key`, once per key (a heartbeat's signature check needs it every time)."""
    return decode_public_key(public_key)


class NodeAuth:
    """Checks join tokens and node signatures; remembers the nonces of the last skew window.

    Args:
        join_token: the token registrations must present (None: not required).
        max_skew_s: largest clock difference a signed call may show, seconds.
    """

    def __init__(self, join_token: str | None = None, max_skew_s: float = MAX_SKEW_S) -> None:
        self.join_token = join_token
        self.max_skew_s = max_skew_s
        self._seen: dict[tuple[str, str], float] = {}  # (node id, nonce) -> forget after (unix s)
        self._pruned_at = 0.0

    def check_join_token(self, headers: Mapping[str, str]) -> None:
        """Raises Unauthorized (401 ``join_token``) when a join token is required and not presented."""
        if not self.join_token:
            return
        given = headers.get(HEADER_JOIN_TOKEN, "")
        if not same_secret(given, self.join_token):
            raise Unauthorized("join token missing or wrong: this tracker admits only nodes that present it",
                               code="join_token", hint="start the node with --join-token (or MESHNET_JOIN_TOKEN)")

    def verify_registration(self, payload: RegisterRequest, headers: Mapping[str, str], method: str, target: str,
                            body: bytes, now: float | None = None) -> None:
        """Check that a registration is signed by the key it registers, as the node id it names.

        Raises:
            Unauthorized (401): unsigned, stale, replayed or not signed by ``payload.public_key``.
            InvalidRequest (422): the public key does not parse.
        """
        signer = signer_of(headers)
        if signer != payload.node_id:
            raise Unauthorized(f"registration of {payload.node_id} signed as {signer}", code="bad_signature")
        self._verify(decode_public_key(payload.public_key), headers, method, target, body, now)

    def verify_node_call(self, public_key: str | None, headers: Mapping[str, str], method: str, target: str,
                         body: bytes, *, as_node: str | None = None, now: float | None = None) -> str:
        """Check a node's signed call; returns the id of the node that signed it.

        Args:
            public_key: the key bound to the signer's id (None: the id was never registered).
            as_node: the node the call must come from (the id in its path), if any.

        Raises:
            Unauthorized (401): unsigned, stale, replayed, a bad signature, or an unknown signer.
            NotFound (404 ``unknown_node``): ``as_node`` was never registered (the node registers
                again on this answer, e.g. after a tracker lost its store).
            Forbidden (403): signed by another node than ``as_node``.
        """
        signer = signer_of(headers)
        if as_node is not None and signer != as_node:
            raise Forbidden(f"{signer} may not act for node {as_node}", code="not_your_node")
        if public_key is None:
            if as_node is not None:
                raise NotFound(f"unknown node {as_node!r}", code="unknown_node",
                               hint="see `meshnet nodes` for node ids (a node itself re-registers on this error)")
            raise Unauthorized(f"unknown signer {signer!r}: not a registered node", code="unknown_signer")
        try:
            key = _decoded_key(public_key)
        except InvalidRequest:  # a stored key is always valid; never let a bad row open the door
            raise Unauthorized(f"no usable key bound to {signer!r}", code="unknown_signer") from None
        self._verify(key, headers, method, target, body, now)
        return signer

    def _verify(self, key, headers: Mapping[str, str], method: str, target: str, body: bytes,
                now: float | None) -> None:
        now = time.time() if now is None else now
        call = verify_request(key, headers, method, target, body, now=now, max_skew_s=self.max_skew_s)
        if now - self._pruned_at >= 1.0:  # at most once a second: the window holds every call of 2 minutes
            self._seen = {k: t for k, t in self._seen.items() if t > now}
            self._pruned_at = now
        if (call.node_id, call.nonce) in self._seen:
            raise Unauthorized(f"replayed call of {call.node_id} (nonce seen before)", code="replayed")
        self._seen[(call.node_id, call.nonce)] = call.timestamp + self.max_skew_s
