"""Clients given every tracker of one database move on when one stops answering (ADR-0043), or
answers nothing within the answer deadline (ADR-0054)."""

from __future__ import annotations

import httpx
import pytest

from meshnet.client import TrackerClient
from meshnet.endpoints import check_endpoints
from meshnet.errors import InvalidRequest, MeshnetError


def test_urls_from_a_list_or_commas_checked_in_order_without_duplicates():
    assert check_endpoints("http://a:1, http://b:2/") == ["http://a:1", "http://b:2"]
    assert check_endpoints(["http://a:1,http://b:2", "http://a:1", "http://c:3"]) == [
        "http://a:1", "http://b:2", "http://c:3"]
    with pytest.raises(InvalidRequest, match="not a usable base URL"):
        check_endpoints("http://a:1,ftp://b")
    with pytest.raises(InvalidRequest):
        check_endpoints([])


class Trackers(httpx.AsyncBaseTransport):
    """Hosts in ``down`` refuse connections; ``slow`` ones time out after the request was sent;
    the others answer /v1/health with their host name."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.slow: set[str] = set()
        self.calls: list[str] = []
        self.deadlines: list[float | None] = []  # each call's read timeout, seconds

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request.url.host)
        self.deadlines.append(request.extensions["timeout"]["read"])
        if request.url.host in self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.url.host in self.slow:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json={"status": "ok", "host": request.url.host})


async def test_a_call_moves_on_to_the_next_tracker_and_stays_there():
    net = Trackers()
    client = TrackerClient("http://t1:8700,http://t2:8700,http://t3:8700", transport=net)
    assert (await client.health())["host"] == "t1"
    net.down.add("t1")
    assert (await client.health())["host"] == "t2"
    assert client.url == "http://t2:8700"
    net.down.discard("t1")
    assert (await client.health())["host"] == "t2"  # it stays with the one that answered
    net.down |= {"t2", "t3"}
    assert (await client.health())["host"] == "t1"  # round the list
    assert net.calls == ["t1", "t1", "t2", "t2", "t2", "t3", "t1"]
    await client.aclose()


async def test_all_down_names_every_url_and_a_write_failing_midway_is_not_resent():
    net = Trackers()
    net.down |= {"t1", "t2"}
    client = TrackerClient(["http://t1:8700", "http://t2:8700"], transport=net)
    with pytest.raises(MeshnetError, match="cannot reach any of http://t1:8700, http://t2:8700") as err:
        await client.health()
    assert err.value.code == "unreachable" and err.value.status == 503
    net.down.clear()
    net.slow.add("t1")
    net.calls.clear()
    net.deadlines.clear()
    with pytest.raises(MeshnetError, match="cannot reach http://t1:8700: ReadTimeout"):
        await client.pin("m", "n1")
    assert net.calls == ["t1"]  # it may have been carried out: not sent again
    assert net.deadlines == [10.0]  # the client's own timeout, not the answer deadline
    assert (await client.health())["host"] == "t2"  # the next call goes elsewhere
    await client.aclose()


async def test_a_hung_tracker_costs_a_read_or_a_heartbeat_one_answer_deadline_then_the_next_answers():
    from meshnet.client import ANSWER_DEADLINE_S
    from meshnet.protocol.control import HeartbeatRequest
    net = Trackers()
    net.slow.add("t1")  # accepts the connection, never answers
    client = TrackerClient("http://t1:8700,http://t2:8700", transport=net, timeout_s=30.0)
    assert (await client.health())["host"] == "t2"
    assert (net.calls, net.deadlines) == (["t1", "t2"], [ANSWER_DEADLINE_S, ANSWER_DEADLINE_S])
    assert client.url == "http://t2:8700"  # it sticks to the one that answered
    net.calls.clear()
    net.deadlines.clear()
    client.url = "http://t1:8700"
    await client._request("POST", "/v1/nodes/n1/heartbeat", "heartbeat", retry=True,
                          json=HeartbeatRequest().model_dump(mode="json"))
    assert net.calls == ["t1", "t2"] and client.url == "http://t2:8700"
    # one URL: nothing to move on to, so the client's own timeout holds
    single = TrackerClient("http://t1:8700", transport=net, timeout_s=30.0)
    net.deadlines.clear()
    with pytest.raises(MeshnetError, match="ReadTimeout"):
        await single.health()
    assert net.deadlines == [30.0]
    await client.aclose()
    await single.aclose()


async def test_a_tracker_without_its_database_passes_a_safe_call_to_the_next():
    """ADR-0054: a 503 ``database_unreachable`` is as good as no answer for a call that may be
    sent again; any other call takes the answer as it is."""
    class NoDatabase(Trackers):
        async def handle_async_request(self, request):
            if request.url.host == "t1":
                self.calls.append("t1")
                return httpx.Response(503, json={"error": {"code": "database_unreachable", "message": "down"}})
            return await super().handle_async_request(request)

    net = NoDatabase()
    client = TrackerClient("http://t1:8700,http://t2:8700", transport=net)
    assert (await client.health())["host"] == "t2" and client.url == "http://t2:8700"
    client.url = "http://t1:8700"
    with pytest.raises(MeshnetError, match="down"):
        await client.pin("m", "n1")
    assert net.calls == ["t1", "t2", "t1"]
    await client.aclose()
