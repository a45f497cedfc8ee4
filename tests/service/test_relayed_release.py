"""A session release reaching a relayed node (ADR-0045): the entry signs the path it called,
``/v1/relay/{node}/v1/sessions/{id}``; the node sees ``/v1/sessions/{id}`` after the tunnel and
checks the signature against its advertised endpoint's path plus that."""

from __future__ import annotations

import httpx
import torch
from asgi_lifespan import LifespanManager

from meshnet.node import wire
from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from meshnet.protocol.tickets import HEADER_TICKET
from tests.payloads import signed
from tests.service.test_hop_tickets import HIDDEN, MODEL, TRACKER, ticket


async def test_a_relayed_node_accepts_a_release_signed_for_its_relayed_path(tiny_model_path):
    runtime = NodeRuntime()
    runtime.load(MODEL, tiny_model_path(MODEL), LayerRange(2, 4))
    app = build_app(NodeSettings(node_id="c", port=1, public_url="http://relay:8700/v1/relay/c"), runtime=runtime)
    async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                       base_url="http://c") as client:
        app.state.node.tracker_key = TRACKER.public_key()
        held = ticket("s1")
        resp = await client.post("/v1/forward", content=wire.encode(torch.randn(1, 3, HIDDEN), dtype="float32"),
                                 headers={"X-Meshnet-Session": "s1", "X-Meshnet-Start-Layer": "2",
                                          "X-Meshnet-End-Layer": "3", "X-Meshnet-Model": MODEL, HEADER_TICKET: held})
        assert resp.status_code == 200
        local = "/v1/sessions/s1"
        other = signed("entry", "DELETE", "/v1/relay/other/v1/sessions/s1")  # signed for another node's path
        refused = await client.delete(local, headers={HEADER_TICKET: held, **other})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "bad_signature"
        assert len(runtime.sessions) == 1
        relayed = signed("entry", "DELETE", "/v1/relay/c" + local)
        ok = await client.delete(local, headers={HEADER_TICKET: held, **relayed})
        assert ok.status_code == 200 and ok.json() == {"released": 1}
        assert len(runtime.sessions) == 0
