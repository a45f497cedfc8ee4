"""The node's tracker agent around a drain: what it tells the tracker, and that it stays truthful
about the link (readiness reads ``last_error`` / ``heartbeat_age_s``). A fake tracker client."""

from __future__ import annotations

import httpx

from meshnet.client import TrackerClient
from meshnet.node.agent import TrackerAgent
from meshnet.node.app import NodeContext
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from tests.payloads import public_key


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


def beat(interval_s: float | None):
    body = {"directives": [], "reachable": True, "reach_error": ""}
    if interval_s is not None:
        body["heartbeat_interval_s"] = interval_s
    return lambda request: httpx.Response(200, json=body)


async def test_a_node_follows_the_announced_interval_longer_or_shorter_than_its_own(tmp_path):
    announced = {"interval_s": 25.0}
    agent, _ = await agent_with(lambda r: beat(announced["interval_s"])(r), tmp_path)
    assert agent.interval_s == 10.0  # its own setting until the tracker says otherwise
    await agent.heartbeat()
    assert agent.interval_s == 25.0  # longer than its own: the tracker's budget wins (ADR-0037)
    announced["interval_s"] = 4.0
    await agent.heartbeat()
    assert agent.interval_s == 4.0
    announced["interval_s"] = None  # an answer without the field leaves the interval unchanged
    await agent.heartbeat()
    assert agent.interval_s == 4.0


async def test_a_registration_sets_the_announced_interval(tmp_path):
    agent, _ = await agent_with(lambda r: httpx.Response(200, json={"node_id": "n1", "heartbeat_interval_s": 30.0,
                                                                   "reachable": True, "reach_error": "",
                                                                   "tracker_key": public_key("tracker")}), tmp_path)
    await agent.start(attempts=1)
    assert agent.interval_s == 30.0
