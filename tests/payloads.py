"""Builders of control-plane payloads for tests, in the exact shape nodes send
(:mod:`meshnet.protocol.control`): a test that drifts from the protocol fails validation."""

from __future__ import annotations

import hashlib
import json
import time

import httpx


def capability_report(model: str, start: int, end: int, *, passed: bool = True, tokens_per_s: float = 100.0,
                      timestamp: float | None = None, reason: str | None = None) -> dict:
    """A doctor report for ``model`` layers ``start..end`` (inclusive), passed or failed."""
    return {"model": model, "shard_start": start, "shard_end": end,
            "recipe": {"quantization": "bfloat16", "compute_dtype": "float32"},
            "hardware": {"device": "cpu", "ram_bytes": 8 * 1024**3, "vram_bytes": 0, "cpu_count": 4, "platform": "test"},
            "weights_digest": "", "tokens_per_s": tokens_per_s if passed else 0.0, "passed": passed,
            "reason": reason or ("forward pass finite and well-shaped" if passed else "probe output has NaN"),
            "timestamp": time.time() if timestamp is None else timestamp}


# ---- node identities (ADR-0035) -------------------------------------------------------------
#
# Every fake node has a fixed key derived from its id, so a test names a node and gets its key.


def node_key(node_id: str, *, salt: str = ""):
    """The fixed Ed25519 key of fake node ``node_id`` (another ``salt``: another key, an impostor's)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"test-node:{node_id}:{salt}".encode()).digest())


def public_key(node_id: str, *, salt: str = "") -> str:
    """``node_key(node_id)``'s public key as a registration carries it."""
    from meshnet.protocol.signing import encode_public_key

    return encode_public_key(node_key(node_id, salt=salt).public_key())


def registration(node_id: str, endpoint: str, **fields) -> dict:
    """A registration body of fake node ``node_id``: this protocol revision and its fixed key."""
    from meshnet.protocol.control import PROTOCOL_REVISION

    return {"protocol": PROTOCOL_REVISION, "node_id": node_id, "public_key": public_key(node_id),
            "endpoint": endpoint, **fields}


def signed(node_id: str, method: str, path: str, body: bytes = b"", *, salt: str = "", now: float | None = None) -> dict:
    """Signature headers of fake node ``node_id`` on one call (``path`` as the tracker sees it)."""
    from meshnet.protocol.signing import sign_request

    return sign_request(node_key(node_id, salt=salt), node_id, method, path, body, now=now)


class SignAsNodes(httpx.Auth):
    """httpx auth for test clients of a tracker: each fake node signs its own calls.

    A registration is signed as the node its body names, a call under ``/v1/nodes/<id>/`` (or
    ``DELETE /v1/nodes/<id>``) as ``<id>``, with that node's fixed key. A request that already
    carries signature headers (a test signing as someone else) or names no node goes as it is.
    """

    requires_request_body = True

    def auth_flow(self, request: httpx.Request):
        from meshnet.protocol.signing import HEADER_SIGNATURE

        node_id = None
        path = request.url.path
        if HEADER_SIGNATURE not in request.headers:
            if path == "/v1/nodes/register":
                try:
                    node_id = json.loads(request.content or b"{}").get("node_id")
                except (ValueError, AttributeError):
                    node_id = None
            elif path.startswith("/v1/nodes/") and path != "/v1/nodes/":
                node_id = path.removeprefix("/v1/nodes/").split("/")[0]
        if node_id:
            request.headers.update(signed(node_id, request.method, path, request.content))
        yield request


async def route_ticket(tracker, entry: str, model: str, start: int, end: int, session: str,
                       exclude: tuple[str, ...] = ()) -> str:
    """The session ticket ``tracker`` (a test client) issues to entry node ``entry`` for layers
    ``start``..``end`` (inclusive) of ``model``, its route avoiding ``exclude``: what an entry's
    failure and quarantine reports carry."""
    query = f"model={model}&start_layer={start}&end_layer={end}&session={session}"
    path = f"/v1/route?{query}" + (f"&exclude={','.join(exclude)}" if exclude else "")
    resp = await tracker.get(path, headers=signed(entry, "GET", path))
    assert resp.status_code == 200, resp.text
    return resp.json()["ticket"]
