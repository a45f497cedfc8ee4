"""Drain (meshnet.drain): the order of a drain, its grace, and the middleware that counts and cuts chats."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from meshnet.drain import Drain, DrainGroup, DrainMiddleware, EventStream
from meshnet.errors import Draining

EVENTS = 10
STEP_S = 0.05


def app_with(drain: Drain) -> Starlette:
    """A chat route streaming EVENTS events STEP_S apart then [DONE], and an untracked route."""

    async def chat(request):
        async def events():
            for i in range(EVENTS):
                await asyncio.sleep(STEP_S)
                yield f"data: {json.dumps({'i': i})}\n\n"
            yield "data: [DONE]\n\n"

        return EventStream(events())

    async def other(request):
        return JSONResponse({"ok": True})

    async def broken(request):
        async def events():
            yield "data: {}\n\n"
            raise RuntimeError("a bug mid-stream")

        return EventStream(events())

    async def lines(request):  # a started response that is no event stream: JSON lines
        async def body():
            for i in range(EVENTS):
                await asyncio.sleep(STEP_S)
                yield json.dumps({"i": i}) + "\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")

    async def slow_json(request):  # nothing sent before the whole answer
        await asyncio.sleep(EVENTS * STEP_S)
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/other", other),
                             Route("/broken", broken, methods=["POST"]), Route("/lines", lines, methods=["POST"]),
                             Route("/slow", slow_json, methods=["POST"])],
                     middleware=[Middleware(DrainMiddleware, drain=drain,
                                            paths=("/v1/chat/completions", "/broken", "/lines", "/slow"))])


def client(drain: Drain) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app_with(drain)), base_url="http://svc")


def data_lines(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def drain_after(drain: Drain, delay_s: float) -> tuple[bool, float]:
    await asyncio.sleep(delay_s)
    t0 = time.monotonic()
    clean = await drain.run()
    return clean, time.monotonic() - t0


async def test_idle_drain_announces_then_leaves_at_once():
    calls = []
    drain = Drain(5.0)

    async def announce():
        calls.append(("announce", drain.draining))

    async def leave():
        calls.append(("leave", drain.draining))

    drain.announce, drain.leave = announce, leave
    t0 = time.monotonic()
    assert await drain.run() is True
    assert time.monotonic() - t0 < 0.5
    assert calls == [("announce", True), ("leave", True)]
    assert not drain.cut.is_set()


async def test_a_failing_hook_does_not_keep_the_drain_from_leaving():
    left = []

    async def announce():
        raise RuntimeError("tracker down")

    async def leave():
        left.append(True)

    drain = Drain(1.0)
    drain.announce, drain.leave = announce, leave
    assert await drain.run() is True
    assert left == [True]


async def test_drain_waits_for_the_apps_idle_test_within_the_grace():
    busy_until = time.monotonic() + 0.3
    drain = Drain(5.0)
    drain.idle = lambda: time.monotonic() >= busy_until
    clean, took = await drain_after(drain, 0)
    assert clean is True
    assert 0.25 <= took < 1.0


async def test_grace_runs_out_cuts_and_still_leaves():
    left = []

    async def leave():
        left.append(drain.cut.is_set())

    drain = Drain(0.2, cut_linger_s=0.1)
    drain.idle, drain.leave = (lambda: False), leave
    clean, took = await drain_after(drain, 0)
    assert clean is False and left == [True]
    assert 0.2 <= took < 1.0


async def test_a_second_run_waits_for_the_first():
    drain = Drain(5.0)
    drain.idle = lambda: drain.started_s is not None and time.monotonic() - drain.started_s > 0.2
    first, second = await asyncio.gather(drain.run(), drain.run())
    assert first is True and second is True


def test_refuse_new_only_while_draining():
    drain = Drain()
    drain.refuse_new("chats")
    drain.draining = True
    with pytest.raises(Draining) as info:
        drain.refuse_new("chats")
    assert info.value.status == 503 and info.value.code == "draining"


def test_negative_grace_is_refused():
    with pytest.raises(ValueError, match="grace"):
        Drain(-1)


async def test_a_stream_in_flight_finishes_whole_and_the_drain_waits_for_it():
    drain = Drain(5.0)
    async with client(drain) as c:
        resp, (clean, took) = await asyncio.gather(c.post("/v1/chat/completions"), drain_after(drain, 0.15))
    lines = data_lines(resp.text)
    assert resp.status_code == 200
    assert lines[-1] == "[DONE]" and len(lines) == EVENTS + 1
    assert clean is True and took >= 0.2  # it waited for the rest of the stream
    assert drain.in_flight == 0


async def test_past_the_grace_a_stream_ends_with_an_error_event():
    drain = Drain(0.1, cut_linger_s=1.0)
    async with client(drain) as c:
        resp, (clean, _) = await asyncio.gather(c.post("/v1/chat/completions"), drain_after(drain, 0.12))
    lines = data_lines(resp.text)
    assert clean is False
    assert "[DONE]" not in lines and len(lines) < EVENTS
    assert json.loads(lines[-1])["error"]["code"] == "draining"
    assert drain.in_flight == 0


async def test_past_the_grace_a_started_response_that_is_no_event_stream_gets_its_end_of_body():
    drain = Drain(0.1, cut_linger_s=1.0)
    async with client(drain) as c:
        resp, (clean, _) = await asyncio.gather(c.post("/lines"), drain_after(drain, 0.12))
    rows = [json.loads(line) for line in resp.text.splitlines()]
    assert clean is False and resp.status_code == 200
    assert 1 <= len(rows) < EVENTS and rows == [{"i": i} for i in range(len(rows))]  # cut, nothing appended
    assert drain.in_flight == 0


async def test_past_the_grace_a_response_not_started_is_a_503_draining():
    drain = Drain(0.1, cut_linger_s=1.0)
    async with client(drain) as c:
        resp, (clean, _) = await asyncio.gather(c.post("/slow"), drain_after(drain, 0.05))
    assert clean is False and resp.status_code == 503
    assert resp.json()["error"]["code"] == "draining" and resp.headers["retry-after"] == "1"
    assert drain.in_flight == 0


async def test_while_draining_a_new_chat_is_503_and_other_routes_still_answer():
    drain = Drain(5.0)
    drain.draining = True
    async with client(drain) as c:
        chat = await c.post("/v1/chat/completions")
        other = await c.get("/other")
    assert chat.status_code == 503
    assert chat.headers["retry-after"] == "1"
    assert chat.json()["error"]["code"] == "draining"
    assert other.status_code == 200


async def test_an_exception_mid_stream_ends_it_with_an_error_event():
    drain = Drain(5.0)
    async with client(drain) as c:
        resp = await c.post("/broken")
    lines = data_lines(resp.text)
    assert resp.status_code == 200 and lines[0] == "{}"
    assert json.loads(lines[-1])["error"]["code"] == "internal_error"
    assert drain.in_flight == 0


async def test_a_drain_group_drains_every_member_and_shares_one_cut():
    quick, slow = Drain(1.0, poll_s=0.01), Drain(0.05, poll_s=0.01, cut_linger_s=0.0)
    slow.idle = lambda: False  # never idle: its grace runs out and it cuts
    left: list[str] = []

    async def leave_quick():
        left.append("quick")

    async def leave_slow():
        left.append("slow")

    quick.leave, slow.leave = leave_quick, leave_slow
    group = DrainGroup(quick, slow)
    assert quick.cut is slow.cut is group.cut and not group.draining
    assert await group.run() is False  # one member had to cut
    assert quick.draining and slow.draining and group.draining and group.in_flight == 0
    assert sorted(left) == ["quick", "slow"] and group.cut.is_set()


async def test_the_middleware_of_a_mounted_app_knows_its_chats_by_its_own_paths():
    from starlette.routing import Mount

    drain = Drain(1.0)
    outer = Starlette(routes=[Mount("/node", app=app_with(drain))])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=outer), base_url="http://t") as client:
        assert (await client.post("/node/v1/chat/completions")).text.endswith("data: [DONE]\n\n")
        drain.draining = True
        refused = await client.post("/node/v1/chat/completions")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert (await client.get("/node/other")).status_code == 200  # not a chat: served while draining
