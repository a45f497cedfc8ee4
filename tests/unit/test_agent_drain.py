"""The node's tracker agent around a drain: what it tells the tracker, and that it stays truthful
about the link (readiness reads ``last_error`` / ``heartbeat_age_s``). A fake tracker client."""

from __future__ import annotations

import httpx
import pytest

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


async def test_a_second_process_of_the_same_node_on_this_host_is_refused_until_the_first_stops(tmp_path):
    import subprocess
    import sys

    from meshnet.errors import MeshnetError

    first, _ = await agent_with(status(404), tmp_path)
    with pytest.raises(MeshnetError, match=r"node n1 runs already on this host") as info:
        await agent_with(status(404), tmp_path)
    assert info.value.code == "node_id_in_use" and info.value.status == 409
    # another process is refused as well (the lock is the operating system's, not this process's)
    probe = ("import sys; from meshnet.node.identity import lock_state_dir\n"
             "try:\n    lock_state_dir(sys.argv[1], 'n1')\nexcept Exception as exc:\n    print(exc.code)")
    held = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert held.stdout.strip() == "node_id_in_use", held.stderr
    # `meshnet node start` says so before its server starts: one line, exit 1, no traceback
    start = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "node", "start", "--tracker", "http://127.0.0.1:9",
                            "--node-id", "n1", "--state-dir", str(tmp_path), "--dtype", "float32", "--threads", "1"],
                           capture_output=True, text=True, timeout=120)
    assert start.returncode == 1 and "Traceback" not in start.stderr
    assert f"error: node n1 runs already on this host (its state directory {tmp_path} is in use)" in start.stderr
    await first.close()
    second, _ = await agent_with(status(404), tmp_path)  # free again once the first let go
    await second.close()
