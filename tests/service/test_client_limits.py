"""Per-client limits (ADR-0060) on the real tracker app in-process: a client holds at most
``max_client_requests`` chats at once through the tracker (a stream counts until it ends); the
next is a 429 naming the limit, other clients and loopback are not held back; the chats the
tracker proxies are signed, so the entry does not count them against the tracker.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from meshnet.protocol.limits import ClientLimit, client_of
from meshnet.protocol.signing import HEADER_NODE, HEADER_SIGNATURE, TRACKER_SIGNER
from meshnet.tracker.app import build_app as build_tracker
from meshnet.tracker.service import TrackerSettings
from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, registration

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
SSE_DONE = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n'
#: the longest a held answer waits for the test to release it, seconds
HOLD_S = 10.0


class HeldBody(httpx.AsyncByteStream):
    """An entry's streamed answer that ends only once ``release`` is set."""

    def __init__(self, release: asyncio.Event) -> None:
        self.release = release

    async def __aiter__(self):
        yield b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        await asyncio.wait_for(self.release.wait(), HOLD_S)
        yield b"data: [DONE]\n\n"


@pytest.fixture
async def mesh(asgi_client):
    """A tracker (limit 2 per client) with one entry node whose streamed answers wait for
    ``mesh.release``; ``mesh.client(address, key=None)`` is an HTTP client from that address."""
    app = build_tracker(TrackerSettings(models=(MODEL,), db_path=":memory:", admission_challenges=False,
                                        max_client_requests=2), run_loop=False, transport=HealthyNodes())
    ops = await asgi_client(app, "http://tracker", auth=SignAsNodes())
    shard = {"model": MODEL, "shard_start": 0, "shard_end": 3, "entry": True, "tier": "pinned",
             "report": capability_report(MODEL, 0, 3)}
    assert (await ops.post("/v1/nodes/register", json=registration("a", "http://a.test:8000",
                                                                   shards=[shard]))).status_code == 200
    release, seen = asyncio.Event(), []

    def entry(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, stream=HeldBody(release), headers={"content-type": "text/event-stream"})

    app.state.http = httpx.AsyncClient(transport=HealthyNodes(httpx.MockTransport(entry)))

    opened: list[httpx.AsyncClient] = []

    async def client(address: str, key: str | None = None) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app, client=(address, 40000))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        opened.append(httpx.AsyncClient(transport=transport, base_url="http://tracker", headers=headers,
                                        timeout=HOLD_S))
        return opened[-1]

    ops.release, ops.seen, ops.client = release, seen, client
    yield ops
    release.set()
    for http in opened:
        await http.aclose()
    await app.state.http.aclose()


async def held_chats(mesh, clients: list[httpx.AsyncClient]) -> list[asyncio.Task]:
    """One chat per client, each held open by the entry (httpx's ASGI transport returns a response
    only once the app is done: the chats run as tasks, counted once the entry has seen them)."""
    before = len(mesh.seen)
    tasks = [asyncio.create_task(c.post("/v1/chat/completions", json=CHAT)) for c in clients]
    for _ in range(int(HOLD_S / 0.01)):
        if len(mesh.seen) == before + len(clients) or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    assert not any(t.done() for t in tasks), [t.result().text for t in tasks if t.done()]
    return tasks


async def test_a_client_holds_at_most_its_limit_and_others_are_not_held_back(mesh):
    outsider = await mesh.client("203.0.113.5")
    held = await held_chats(mesh, [outsider, outsider])

    refused = await outsider.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("too_many_requests", "rate_limit_error")
    assert error["message"] == ("address 203.0.113.5 has 2 generation requests in flight; at most 2 at once per "
                                "client")

    # another address, a key of its own from the same address, and the operator's loopback go on
    others = await held_chats(mesh, [await mesh.client("198.51.100.7"), await mesh.client("203.0.113.5", key="alice"),
                                     await mesh.client("127.0.0.1")])

    # the streams end: the client may chat again
    mesh.release.set()
    for done in await asyncio.gather(*held, *others):
        assert done.status_code == 200 and done.text.endswith("data: [DONE]\n\n")
    again = await outsider.post("/v1/chat/completions", json=CHAT)
    assert again.status_code == 200 and again.text.endswith("data: [DONE]\n\n")


async def test_a_proxied_chat_is_signed_by_the_tracker(mesh):
    mesh.release.set()
    resp = await (await mesh.client("203.0.113.5")).post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    (headers,) = mesh.seen
    assert headers[HEADER_NODE] == TRACKER_SIGNER and headers[HEADER_SIGNATURE]


async def test_an_exempt_request_is_not_counted():
    """The entry node's rule: a chat its tracker signed is not counted (``exempt``)."""
    gate = asyncio.Event()

    async def slow(request):
        await asyncio.wait_for(gate.wait(), HOLD_S)
        return JSONResponse({"ok": True})

    app = ClientLimit(Starlette(routes=[Route("/v1/completions", slow, methods=["POST"])]), max_requests=1,
                      exempt=lambda scope: dict(scope["headers"]).get(b"x-proxied") == b"1")
    transport = httpx.ASGITransport(app=app, client=("203.0.113.9", 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
        first = asyncio.create_task(http.post("/v1/completions", json={}))
        await asyncio.sleep(0.05)
        proxied = asyncio.create_task(http.post("/v1/completions", json={}, headers={"x-proxied": "1"}))
        await asyncio.sleep(0.05)
        refused = await http.post("/v1/completions", json={})
        gate.set()
        assert [(await first).status_code, (await proxied).status_code, refused.status_code] == [200, 200, 429]
        assert app.in_flight == {}


@pytest.mark.parametrize(("scope", "expected"), [
    ({"headers": [(b"authorization", b"Bearer alice")], "client": ("203.0.113.5", 1)},
     "key:2bd806c97f0e00af"),
    ({"headers": [], "client": ("203.0.113.5", 1)}, "addr:203.0.113.5"),
    ({"headers": [(b"authorization", b"Bearer ")], "client": ("2001:db8::1", 1)}, "addr:2001:db8::1"),
    ({"headers": [], "client": ("127.0.0.1", 1)}, None),
    ({"headers": [], "client": ("::1", 1)}, None),
    ({"headers": [], "client": None}, None),
])
def test_who_a_client_is(scope, expected):
    assert client_of(scope) == expected


def test_an_entry_exempts_exactly_the_chats_its_tracker_signed():
    """:func:`meshnet.node.callers.proxied_by_tracker` on the scope of a chat to an entry node."""
    from types import SimpleNamespace

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshnet.node.callers import proxied_by_tracker
    from meshnet.tracker.tickets import TicketIssuer

    tracker, impostor = TicketIssuer(Ed25519PrivateKey.generate()), TicketIssuer(Ed25519PrivateKey.generate())
    node = SimpleNamespace(tracker_key=tracker.key.public_key(), agent=None,
                           settings=SimpleNamespace(endpoint="http://a.test:8000"))

    def scope(headers: dict, tracker_key=node.tracker_key) -> dict:
        state = SimpleNamespace(node=SimpleNamespace(**{**vars(node), "tracker_key": tracker_key}))
        return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
                "app": SimpleNamespace(state=state), "client": ("198.51.100.1", 1)}

    url = "http://a.test:8000/v1/chat/completions"
    assert proxied_by_tracker(scope(tracker.sign_call("POST", url))) is True
    assert proxied_by_tracker(scope(impostor.sign_call("POST", url))) is False
    assert proxied_by_tracker(scope(tracker.sign_call("POST", "http://a.test:8000/v1/completions"))) is False
    assert proxied_by_tracker(scope({})) is False
    assert proxied_by_tracker(scope(tracker.sign_call("POST", url), tracker_key=None)) is False
