"""The node's tracker agent around a drain: what it tells the tracker, and that it stays truthful
about the link (readiness reads ``last_error`` / ``heartbeat_age_s``). A fake tracker client."""

from __future__ import annotations

import httpx

from meshnet.client import TrackerClient
from meshnet.node.agent import TrackerAgent
from meshnet.node.app import NodeContext
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings


def tracker(handler) -> TrackerClient:
    return TrackerClient("http://tracker.test", transport=httpx.MockTransport(handler))


async def agent_with(handler, state_dir) -> tuple[TrackerAgent, list[str]]:
    calls: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        return handler(request)

    async with httpx.AsyncClient() as http:
        node = NodeContext(settings=NodeSettings(node_id="n1", port=8901, tracker_url="http://tracker.test",
                                                   state_dir=state_dir),
                         runtime=NodeRuntime(), http=http)
    agent = TrackerAgent(node)
    agent.client = tracker(record)
    node.agent = agent
    return agent, calls


def status(code: int, error: str = "unknown_node"):
    return lambda request: httpx.Response(code, json={"error": {"message": error, "type": "x", "code": error}})


async def test_a_failed_reregistration_is_recorded_and_the_loop_survives(tmp_path):
    agent, calls = await agent_with(lambda r: status(404)(r) if r.url.path.endswith("heartbeat")
                                    else status(503, "unreachable")(r), tmp_path)
    await agent.heartbeat()  # must not raise
    assert calls == ["POST /v1/nodes/n1/heartbeat", "POST /v1/nodes/register"]
    assert agent.last_error and "503" in agent.last_error and agent.heartbeat_age_s() is None


async def test_a_draining_node_does_not_register_again_and_stops_heartbeating_once_it_left(tmp_path):
    agent, calls = await agent_with(lambda r: status(404)(r) if r.url.path.endswith("heartbeat")
                                    else httpx.Response(200, json={"node_id": "n1", "deregistered": True}),
                                    tmp_path)
    agent.node.drain.draining = True
    await agent.heartbeat()
    assert calls == ["POST /v1/nodes/n1/heartbeat"]  # forgotten while draining: stays forgotten
    await agent.announce_drain()
    await agent.leave()
    await agent.heartbeat()
    assert calls[1:] == ["POST /v1/nodes/n1/drain", "DELETE /v1/nodes/n1"]
