"""The node's outbound calls go through an injectable transport: a service test needs no tracker
server. The payloads it sends are the protocol's typed models (a renamed field would fail here)."""

from __future__ import annotations

import asyncio
import json

import httpx

from meshnet.node.app import build_app
from meshnet.node.settings import NodeSettings
from meshnet.protocol.control import HeartbeatRequest, HeartbeatResponse, RegisterRequest, RegisterResponse
from tests.payloads import public_key


async def test_a_node_registers_and_heartbeats_through_an_injected_transport(asgi_client, tmp_path):
    seen: list[tuple[str, dict]] = []

    def tracker(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        seen.append((request.url.path, body))
        if request.url.path == "/v1/nodes/register":
            RegisterRequest.model_validate(body)
            return httpx.Response(200, json=RegisterResponse(node_id=body["node_id"],
                                                             heartbeat_interval_s=0.05,
                                                             tracker_key=public_key("tracker")).model_dump())
        if request.url.path.endswith("/heartbeat"):
            HeartbeatRequest.model_validate(body)
            return httpx.Response(200, json=HeartbeatResponse().model_dump())
        return httpx.Response(404, json={"error": {"message": "no", "type": "x", "code": "not_found"}})

    settings = NodeSettings(node_id="n-inj", port=8899, tracker_url="http://tracker.test", heartbeat_interval_s=0.05,
                            state_dir=tmp_path)
    node = await asgi_client(build_app(settings, transport=httpx.MockTransport(tracker)), "http://n-inj")
    for _ in range(100):  # bounded: the heartbeat loop runs every 0.05 s
        if any(path.endswith("/heartbeat") for path, _ in seen):
            break
        await asyncio.sleep(0.02)
    paths = [path for path, _ in seen]
    assert paths[0] == "/v1/nodes/register" and "/v1/nodes/n-inj/heartbeat" in paths
    registration = seen[0][1]
    assert registration["endpoint"] == "http://127.0.0.1:8899" and registration["shards"] == []
    assert (await node.get("/v1/health")).json()["node_id"] == "n-inj"
