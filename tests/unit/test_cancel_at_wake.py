"""A loop cancelled at the moment its wake event is set stops (the teardown hang of CI stop 42).

On Python 3.11 ``asyncio.wait_for`` returns the inner result when the awaited event completes in
the same loop step as the cancel, so the cancel is lost: a tracker's control loop kept running
after its lifespan cancelled it, and the shutdown waited for it until a 30 s timeout. meshnet waits
with ``asyncio.timeout`` instead; these tests hit that very instant, and a source check keeps
``asyncio.wait_for`` out of the packages.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager

from meshnet.tracker.app import build_app, control_loop
from meshnet.tracker.service import TrackerSettings
from tests.unit.test_agent_drain import agent_with

ROOT = Path(__file__).resolve().parents[2]


async def stops_when_cancelled_at_its_wake(loop: asyncio.Task, wake: asyncio.Event) -> None:
    await asyncio.sleep(0.05)  # the loop waits on ``wake`` now
    wake.set()
    loop.cancel()  # in the same step: the event's waiter and the cancel are both due
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):  # a lost cancel would leave the loop running past this
            await loop


async def test_the_node_agents_heartbeat_loop_stops_when_cancelled_as_it_is_woken(tmp_path):
    agent, calls = await agent_with(lambda r: httpx.Response(200, json={}), tmp_path)
    agent.leaving = True  # a round sends nothing
    await stops_when_cancelled_at_its_wake(asyncio.create_task(agent.run()), agent.wake)
    assert calls == []


async def test_the_trackers_control_loop_stops_when_cancelled_as_it_is_woken():
    app = build_app(TrackerSettings(models=("tiny-llama",), join_settle_s=0.0), run_loop=False)
    async with LifespanManager(app):
        await stops_when_cancelled_at_its_wake(asyncio.create_task(control_loop(app)), app.state.wake)


async def test_wait_event_says_whether_it_was_woken_and_passes_a_cancel_on():
    from meshnet.protocol.waits import wait_event

    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0) is True
    event.clear()
    await stops_when_cancelled_at_its_wake(asyncio.create_task(wait_event(event, 5.0)), event)


def test_no_module_waits_with_asyncio_wait_for():
    calls = []
    for path in [*sorted((ROOT / "meshnet").rglob("*.py")), *sorted((ROOT / "tui").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for" and getattr(node.value, "id", "") == "asyncio":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []
