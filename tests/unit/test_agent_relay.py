"""When a node moves to a relay by itself (ADR-0045): only once its own listener answers and the
tracker still cannot reach it :data:`AUTO_RELAY_AFTER_S` later; never with --no-auto-relay."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from meshnet.node import reachability as agent_module
from meshnet.node.agent import TrackerAgent
from meshnet.protocol.control import HeartbeatResponse


def make_agent(*, listening: bool, auto_relay: bool = True) -> tuple[TrackerAgent, list[str]]:
    agent = TrackerAgent.__new__(TrackerAgent)
    agent.settings = SimpleNamespace(auto_relay=auto_relay, endpoint="http://10.0.0.2:8821", node_id="n1")
    agent.reachable, agent._probed_again = None, False
    agent.tunnel, agent._considering, agent._listening_since = None, None, None
    agent.wake = asyncio.Event()
    switched: list[str] = []

    async def is_listening() -> bool:
        return listening

    async def switch() -> None:
        switched.append("relay")
        agent.tunnel = SimpleNamespace(endpoint="http://tracker/v1/relay/n1")

    agent._listening, agent.switch_to_relay = is_listening, switch
    return agent, switched


def unreachable() -> HeartbeatResponse:
    return HeartbeatResponse(directives=[], reachable=False, reach_error="GET http://10.0.0.2:8821/v1/health failed")


async def verdicts(agent: TrackerAgent, count: int, gap_s: float) -> None:
    for _ in range(count):
        agent.note_reachability(unreachable())
        await asyncio.sleep(0)
        if agent._considering is not None:
            await agent._considering
        await asyncio.sleep(gap_s)


@pytest.fixture(autouse=True)
def short_wait(monkeypatch):
    monkeypatch.setattr(agent_module, "AUTO_RELAY_AFTER_S", 0.05)


async def test_a_listening_node_the_tracker_still_cannot_reach_moves_to_the_relay():
    agent, switched = make_agent(listening=True)
    await verdicts(agent, 1, 0.0)
    assert switched == [] and agent._listening_since is not None  # first seen listening: wait for a fresh verdict
    await verdicts(agent, 1, 0.06)
    await verdicts(agent, 1, 0.0)
    assert switched == ["relay"]
    await verdicts(agent, 2, 0.06)
    assert switched == ["relay"]  # once: a node with a tunnel does not move again


async def test_a_node_that_does_not_listen_yet_stays_put():
    agent, switched = make_agent(listening=False)
    await verdicts(agent, 4, 0.06)
    assert switched == [] and agent._listening_since is None


async def test_no_auto_relay_keeps_the_node_unadmitted():
    agent, switched = make_agent(listening=True, auto_relay=False)
    await verdicts(agent, 4, 0.06)
    assert switched == [] and agent._considering is None
    assert agent.reachable is False


async def test_a_node_whose_relay_node_is_gone_moves_to_the_trackers_relay(monkeypatch):
    """--relay-url names another node; its tunnel stays down past RELAY_FALLBACK_S: the agent attaches
    to the tracker's relay instead and registers that endpoint (no operator)."""
    monkeypatch.setattr(agent_module, "RELAY_FALLBACK_S", 0.05)
    agent, _ = make_agent(listening=True)
    agent.settings = SimpleNamespace(tracker_url="http://tracker:8700", relay_url="http://relay-node:8821",
                                     node_id="n1", endpoint="http://10.0.0.2:8821", auto_relay=True, local_url="")
    agent.key = None
    agent._tunnel_task = None
    agent.tunnel = agent._new_tunnel()
    assert agent.tunnel.relay_url == "http://relay-node:8821" and not agent.relay_lost()
    moved = []

    async def switch() -> None:
        moved.append(agent.tunnel.endpoint)

    agent.switch_to_relay = switch
    await asyncio.sleep(0.06)
    assert agent.relay_lost()
    await agent.fall_back_to_tracker_relay()
    assert moved == ["http://tracker:8700/v1/relay/n1"]
    assert not agent.relay_lost()  # the tracker is the relay now: nothing further to fall back to
