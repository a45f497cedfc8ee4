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


def relayed_agent(monkeypatch, trackers: str, relay_url: str | None = None) -> tuple[TrackerAgent, list[str]]:
    """An agent given ``trackers``, relayed through ``relay_url`` (None: the first tracker), whose
    re-attach records the endpoint it would register."""
    agent, _ = make_agent(listening=True)
    agent.settings = SimpleNamespace(tracker_url=trackers, relay_url=relay_url, node_id="n1",
                                     endpoint="http://10.0.0.2:8821", auto_relay=True, local_url="")
    agent.key, agent._tunnel_task = None, None
    agent.client = SimpleNamespace(url=trackers.split(",")[0], urls=trackers.split(","))
    agent.tunnel = agent._new_tunnel()
    moved: list[str] = []

    async def switch() -> None:
        moved.append(agent.tunnel.endpoint)

    agent.switch_to_relay = switch
    return agent, moved


async def test_a_node_relayed_through_a_tracker_that_stopped_answering_moves_to_the_one_that_answers(monkeypatch):
    """Two trackers; the node's tunnel is at the first. While the first still takes the node's calls
    its tunnel waits for itself, however long down; once the calls went to the second (the first did
    not answer), the tunnel down TRACKER_RELAY_FALLBACK_S moves to the second's relay."""
    monkeypatch.setattr(agent_module, "TRACKER_RELAY_FALLBACK_S", 0.05)
    agent, moved = relayed_agent(monkeypatch, "http://a:8700,http://b:8700")
    assert agent.tunnel.relay_url == "http://a:8700"  # the tracker the calls go to, not the list
    await asyncio.sleep(0.06)
    assert not agent.relay_lost()  # still the tracker that answers: its tunnel dials again by itself
    agent.client.url = "http://b:8700"  # a heartbeat got no answer from a: the client moved to b
    assert agent.relay_lost()
    await agent.fall_back_to_tracker_relay()
    assert moved == ["http://b:8700/v1/relay/n1"]
    assert not agent.relay_lost()


async def test_a_relay_node_waits_longer_than_a_tracker_relay(monkeypatch):
    monkeypatch.setattr(agent_module, "TRACKER_RELAY_FALLBACK_S", 0.05)
    agent, _ = relayed_agent(monkeypatch, "http://a:8700,http://b:8700", relay_url="http://relay-node:8821")
    await asyncio.sleep(0.06)
    assert agent.tunnel.down_for_s() > 0.05 and not agent.relay_lost()  # RELAY_FALLBACK_S (30 s) for a node
