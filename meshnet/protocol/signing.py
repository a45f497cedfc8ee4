"""Signed node calls (ADR-0035): an Ed25519 signature over what a request does, in headers.

A node signs every call it makes to the tracker with its own key (:mod:`meshnet.node.identity`).
The signed message binds the method, the path (with its query string), the signer's node id,
a timestamp, a random nonce and the SHA-256 of the body, so a signature cannot be moved to
another call, another body or another node, and a captured one goes stale after
:data:`MAX_SKEW_S`. The receiver refuses a nonce it has seen (see
:class:`meshnet.tracker.auth.NodeAuth`).

Keys travel as base64url (no padding) of their raw bytes: 32 for a public key, 64 for a
signature. Torch-free and service-free: the node signs with it, the tracker verifies with it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet.errors import InvalidRequest, Unauthorized

__all__ = ["HEADER_JOIN_TOKEN", "HEADER_NODE", "HEADER_NONCE", "HEADER_SIGNATURE", "HEADER_TIMESTAMP", "MAX_SKEW_S", "SignedCall", "TRACKER_SIGNER", "b64url",
           "decode_public_key", "encode_public_key", "sign_request", "signed_message", "signer_of", "unb64url", "verify_request"]

#: a registration's proof that the node may join (the tracker's join token)
HEADER_JOIN_TOKEN = "X-Meshnet-Join-Token"
HEADER_NODE = "X-Meshnet-Node"
HEADER_TIMESTAMP = "X-Meshnet-Timestamp"
HEADER_NONCE = "X-Meshnet-Nonce"
HEADER_SIGNATURE = "X-Meshnet-Signature"
#: a signed call whose timestamp is further than this from the receiver's clock is refused, seconds
MAX_SKEW_S = 60.0
#: the signer name of a call the tracker signs with its key (a node checks it against the tracker's
#: key, whatever the name; ADR-0049)
TRACKER_SIGNER = "tracker"
#: domain separation: a meshnet request signature is never valid as anything else
_CONTEXT = "meshnet-request/1"


def b64url(data: bytes) -> str:
    """base64url of ``data``, without padding (how keys, signatures and tickets travel)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    """Bytes of :func:`b64url` text (padding optional).

    Raises:
        binascii.Error, ValueError: not base64url.
    """
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_public_key(key: Ed25519PublicKey) -> str:
    """The public key as it travels in a registration: base64url of its 32 raw bytes (43 chars)."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return b64url(key.public_bytes(Encoding.Raw, PublicFormat.Raw))


def decode_public_key(text: str) -> Ed25519PublicKey:
    """Parse a public key written by :func:`encode_public_key`.

    Raises:
        InvalidRequest (422 ``invalid_field``): not base64url of 32 bytes.
    """
    try:
        raw = unb64url(text)
        if len(raw) != 32:
            raise ValueError(f"{len(raw)} bytes, not 32")
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, binascii.Error) as exc:
        raise InvalidRequest(f"invalid field 'public_key': not an Ed25519 public key ({exc})",
                             code="invalid_field", status=422, param="public_key") from None


def signed_message(method: str, target: str, node_id: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    """The bytes a node signs: context, method, target (path and ``?query``), node id, timestamp
    (unix seconds as sent), nonce and the body's SHA-256 (hex), one per line."""
    return "\n".join([_CONTEXT, method.upper(), target, node_id, timestamp, nonce,
                      hashlib.sha256(body).hexdigest()]).encode()


def sign_request(key: Ed25519PrivateKey, node_id: str, method: str, target: str, body: bytes, *,
                 now: float | None = None, nonce: str | None = None) -> dict[str, str]:
    """The headers that sign one call of ``node_id``: ``target`` is the path with its query string
    (``/v1/nodes/n1/heartbeat``), ``body`` the exact bytes sent, ``now`` unix seconds."""
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = nonce or secrets.token_hex(16)
    signature = key.sign(signed_message(method, target, node_id, timestamp, nonce, body))
    return {HEADER_NODE: node_id, HEADER_TIMESTAMP: timestamp, HEADER_NONCE: nonce, HEADER_SIGNATURE: b64url(signature)}


@dataclass(frozen=True)
class SignedCall:
    """Who signed a verified call, when (unix seconds, the signer's clock) and with which nonce."""

    node_id: str
    timestamp: float
    nonce: str


def signer_of(headers: Mapping[str, str]) -> str:
    """The node id a call claims to be signed by.

    Raises:
        Unauthorized (401): the call carries no signature headers.
    """
    node_id = headers.get(HEADER_NODE, "")
    if not node_id or not headers.get(HEADER_SIGNATURE):
        raise Unauthorized("node call is not signed", code="unsigned",
                           hint=f"a node signs its calls ({HEADER_NODE}, {HEADER_SIGNATURE} headers; ADR-0035)")
    return node_id


def verify_request(public_key: Ed25519PublicKey, headers: Mapping[str, str], method: str, target: str, body: bytes,
                   *, now: float | None = None, max_skew_s: float = MAX_SKEW_S) -> SignedCall:
    """Check a call's signature headers against ``public_key`` (``now``: unix seconds).

    Replays within the skew window are not detected here (the receiver keeps the nonces).

    Raises:
        Unauthorized (401): headers missing or malformed, a timestamp more than ``max_skew_s``
            away from ``now`` (``stale_signature``), or a signature that does not verify
            (``bad_signature``: another key, or any signed part changed).
    """
    node_id = signer_of(headers)
    timestamp, nonce = headers.get(HEADER_TIMESTAMP, ""), headers.get(HEADER_NONCE, "")
    try:
        sent_at = float(timestamp)
        signature = unb64url(headers[HEADER_SIGNATURE])
    except (ValueError, binascii.Error):
        raise Unauthorized("malformed signature headers", code="bad_signature") from None
    if not nonce or len(nonce) > 64 or not math.isfinite(sent_at):
        raise Unauthorized("malformed signature headers (nonce or timestamp)", code="bad_signature")
    now = time.time() if now is None else now
    if abs(now - sent_at) > max_skew_s:
        raise Unauthorized(f"signed call from {node_id} is {now - sent_at:+.0f} s off the tracker's clock "
                           f"(at most {max_skew_s:.0f} s)", code="stale_signature",
                           hint="sync the node's clock (NTP); a replayed call also ends up here")
    try:
        public_key.verify(signature, signed_message(method, target, node_id, timestamp, nonce, body))
    except InvalidSignature:
        raise Unauthorized(f"signature of {node_id}'s call does not verify against its registered key",
                           code="bad_signature") from None
    return SignedCall(node_id, sent_at, nonce)
