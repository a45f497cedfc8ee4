"""Session tickets on hop traffic (ADR-0038): real node apps over ASGI, tiny seeded model.

The entry holds layers [0, 2) and node ``c`` holds [2, 4). ``c`` knows the tracker's key (as a
node that registered does), so it runs hops and releases sessions only with a ticket the
tracker signed. Routes come from a :class:`TicketIssuer` with that key (the tracker's own
issuer); the tracker's ``GET /v1/route?session=`` is tested at the end.
"""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
import torch
from asgi_lifespan import LifespanManager

from meshnet.node import wire
from meshnet.client import NodeSigner
from meshnet.errors import NotFound
from meshnet.dataplane.failover import settle_releases
from meshnet.dataplane.failover import MeshLink
from meshnet.dataplane.chain import ChainEnd
from meshnet.gateway.pipeline import GenerationStats, Orchestrator, OrchestratorSettings
from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from meshnet.node.entry import LocalEntry
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from meshnet.protocol.openai import SamplingParams
from meshnet.protocol.route import Hop, Route
from meshnet.protocol.signing import decode_public_key
from meshnet.protocol.tickets import HEADER_TICKET, read_ticket
from meshnet.tracker.app import build_app as build_tracker
from meshnet.tracker.service import TrackerSettings
from meshnet.tracker.tickets import TicketIssuer
from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, node_key, public_key, registration, signed

MODEL = "tiny-llama"
HIDDEN = 64
PROMPT = list(range(3, 40))
TRACKER = node_key("tracker")
DEAD = "http://127.0.0.1:9"  # nothing listens on port 9


@pytest.fixture
async def mesh(tiny_model_path):
    """``(runtimes, client reaching http://c and http://open)``: ``c`` requires tickets, ``open``
    (the same layers) is a node without a tracker, which requires none."""
    path = tiny_model_path(MODEL)
    runtimes = {name: NodeRuntime() for name in ("entry", "c", "open")}
    runtimes["entry"].load(MODEL, path, LayerRange(0, 2))
    for name in ("c", "open"):
        runtimes[name].load(MODEL, path, LayerRange(2, 4))
    async with contextlib.AsyncExitStack() as stack:
        mounts = {}
        for name in ("c", "open"):
            app = build_app(NodeSettings(node_id=name, port=1), runtime=runtimes[name])
            await stack.enter_async_context(LifespanManager(app))
            if name == "c":
                app.state.node.tracker_key = TRACKER.public_key()
            mounts[f"http://{name}"] = httpx.ASGITransport(app=app)
        client = await stack.enter_async_context(httpx.AsyncClient(mounts=mounts))
        yield runtimes, client


def ticketed(issuer: TicketIssuer | None, *names: str, calls: list | None = None):
    """Route provider: the first of ``names`` not excluded, with a ticket from ``issuer`` (None: no ticket)."""
    async def routes(model, layers, exclude, session_id):
        if calls is not None:
            calls.append(session_id)
        for name in names:
            if name not in exclude:
                hops = [Hop(name, DEAD if name == "dead" else f"http://{name}", layers)]
                ticket = None if issuer is None else issuer.issue(
                    session=session_id, model=model, entry="entry", entry_key=public_key("entry"), hops=hops)
                return Route(hops, ticket)
        raise NotFound(f"no node serves layers {layers}", code="model_loading")
    return routes


def orchestrator(runtimes, client, routes, reported: list | None = None, named: list | None = None) -> Orchestrator:
    """``reported``: the failed hops reported; ``named``: for each report whose ticket came with it,
    the hops that ticket names."""
    async def report(node_id, reason, ticket=None):
        if ticket is not None and named is not None:
            named.append(sorted(h.node_id for h in read_ticket(ticket, TRACKER.public_key()).hops))
        if reported is not None:
            reported.append(node_id)

    entry = runtimes["entry"]
    return Orchestrator(LocalEntry(entry, next(iter(entry.slots.values())), wire_dtype="float32"),
                        end=ChainEnd("entry", "http://entry"),
                        link=MeshLink(client, routes, report, NodeSigner("entry", node_key("entry"))),
                        settings=OrchestratorSettings(chunk_tokens=8))


async def generate(orch) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    tokens = [t async for t in orch.generate(PROMPT, SamplingParams(max_tokens=8), stats)]
    return tokens, stats


def ticket(session: str, node: str = "c", layers: LayerRange = LayerRange(2, 4), entry: str = "entry") -> str:
    return TicketIssuer(TRACKER).issue(session=session, model=MODEL, entry=entry, entry_key=public_key(entry),
                                       hops=[Hop(node, f"http://{node}", layers)])


async def forward(client, session: str, headers: dict | None = None, start: int = 2, end: int = 3) -> httpx.Response:
    return await client.post("http://c/v1/forward", content=wire.encode(torch.randn(1, 3, HIDDEN), dtype="float32"),
                             headers={"X-Meshnet-Session": session, "X-Meshnet-Start-Layer": str(start),
                                      "X-Meshnet-End-Layer": str(end), "X-Meshnet-Position": "0",
                                      "X-Meshnet-Model": MODEL, **(headers or {})})


# each case's headers are made when the test runs: a ticket made at collection could expire
# (TICKET_TTL_S) before a long suite reaches the test, and be refused for that instead
@pytest.mark.parametrize("headers, status, code", [
    (lambda: {}, 401, "ticket_missing"),
    (lambda: {HEADER_TICKET: "forged.ticket"}, 401, "ticket_invalid"),
    (lambda: {HEADER_TICKET: ticket("s1", node="c", layers=LayerRange(2, 3))}, 403, "ticket_scope"),  # other layers
    (lambda: {HEADER_TICKET: ticket("another-session")}, 403, "ticket_scope"),
    (lambda: {HEADER_TICKET: ticket("s1", node="open")}, 403, "ticket_scope"),  # names another node
], ids=["missing", "forged", "other-layers", "other-session", "other-node"])
async def test_a_hop_call_without_a_valid_ticket_is_refused_and_touches_no_cache(mesh, headers, status, code):
    runtimes, client = mesh
    resp = await forward(client, "s1", headers())
    assert resp.status_code == status and resp.json()["error"]["code"] == code
    assert len(runtimes["c"].sessions) == 0 and runtimes["c"].tokens_processed == 0
    ok = await forward(client, "s1", {HEADER_TICKET: ticket("s1")})
    assert ok.status_code == 200 and len(runtimes["c"].sessions) == 1


async def test_only_the_sessions_entry_can_release_it(mesh):
    runtimes, client = mesh
    stolen = ticket("s1")
    assert (await forward(client, "s1", {HEADER_TICKET: stolen})).status_code == 200
    path = "/v1/sessions/s1"
    attempts = [({}, 401),                                                  # nothing: no ticket
                ({HEADER_TICKET: stolen}, 401),                             # the ticket alone, unsigned
                ({HEADER_TICKET: stolen, **signed("mallory", "DELETE", path)}, 403),   # someone else's key
                ({HEADER_TICKET: stolen, **signed("entry", "DELETE", path, salt="x")}, 401),  # forged as the entry
                ({HEADER_TICKET: ticket("s1", entry="mallory"), **signed("entry", "DELETE", path)}, 403),
                ({HEADER_TICKET: ticket("s2"), **signed("entry", "DELETE", path)}, 403)]   # another session's
    for headers, status in attempts:
        resp = await client.delete(f"http://c{path}", headers=headers)
        assert resp.status_code == status, (headers, resp.text)
        assert len(runtimes["c"].sessions) == 1  # the session survives
    resp = await client.delete(f"http://c{path}", headers={HEADER_TICKET: stolen, **signed("entry", "DELETE", path)})
    assert resp.status_code == 200 and resp.json() == {"released": 1}
    assert len(runtimes["c"].sessions) == 0


async def test_a_generation_with_tickets_gives_the_same_tokens_and_releases_its_sessions(mesh):
    runtimes, client = mesh
    expected, _ = await generate(orchestrator(runtimes, client, ticketed(None, "open")))
    got, stats = await generate(orchestrator(runtimes, client, ticketed(TicketIssuer(TRACKER), "c")))
    assert got == expected and len(got) == 8
    assert [h.node_id for h in stats.route] == ["entry", "c"] and stats.failovers == 0
    await settle_releases(5.0)
    assert len(runtimes["c"].sessions) == 0  # released by the entry's signed DELETE with the ticket


async def test_a_generation_without_tickets_is_refused_by_a_node_that_requires_them(mesh):
    runtimes, client = mesh
    reported = []
    with pytest.raises(Exception, match="ticket_missing"):
        await generate(orchestrator(runtimes, client, ticketed(None, "c"), reported))
    assert len(runtimes["c"].sessions) == 0


async def test_failover_gets_a_fresh_ticket_that_the_replacement_accepts(mesh):
    runtimes, client = mesh
    expected, _ = await generate(orchestrator(runtimes, client, ticketed(None, "open")))
    issuer, calls, reported, named = TicketIssuer(TRACKER), [], [], []
    got, stats = await generate(orchestrator(runtimes, client, ticketed(issuer, "dead", "c", calls=calls), reported,
                                             named))
    assert got == expected
    assert named == [["dead"]]  # the report carries the ticket of the route that named the failed hop
    assert reported == ["dead"] and stats.failovers == 1 and [h.node_id for h in stats.route] == ["entry", "c"]
    assert len(calls) == 2 and calls[0] == calls[1]  # the same session asked twice: a ticket per route
    await settle_releases(5.0)
    assert len(runtimes["c"].sessions) == 0


async def test_an_expired_ticket_is_renewed_by_asking_again_without_a_failure_report(mesh):
    runtimes, client = mesh
    expected, _ = await generate(orchestrator(runtimes, client, ticketed(None, "open")))
    fresh, calls = ticketed(TicketIssuer(TRACKER), "c"), []

    async def routes(model, layers, exclude, session_id):
        calls.append(set(exclude))
        route = await fresh(model, layers, exclude, session_id)
        if len(calls) == 1:  # the first ticket ran out ten minutes ago
            expired = TicketIssuer(TRACKER).issue(session=session_id, model=model, entry="entry",
                                                  entry_key=public_key("entry"), hops=route.hops, now=time.time() - 700)
            return Route(route.hops, expired)
        return route

    reported = []
    got, stats = await generate(orchestrator(runtimes, client, routes, reported))
    assert got == expected
    assert reported == [] and calls == [set(), set()]  # c stays eligible and is not reported
    assert stats.failovers == 1 and [h.node_id for h in stats.route] == ["entry", "c"]


# ---- the tracker issues them ------------------------------------------------------------------


async def test_the_tracker_issues_a_ticket_for_a_session_only_to_its_entry(asgi_client):
    app = build_tracker(TrackerSettings(models=(MODEL,), db_path=":memory:"), run_loop=False, transport=HealthyNodes())
    tracker = await asgi_client(app, "http://tracker", auth=SignAsNodes())
    shards = {"entry": (0, 1, True), "other-entry": (0, 1, True), "c": (2, 3, False)}
    keys = {}
    for node, (start, end, is_entry) in shards.items():
        shard = {"model": MODEL, "shard_start": start, "shard_end": end, "entry": is_entry,
                 "report": capability_report(MODEL, start, end)}
        resp = await tracker.post("/v1/nodes/register", json=registration(node, f"http://{node}.test:8000",
                                                                           shards=[shard]))
        assert resp.status_code == 200, resp.text
        keys[node] = resp.json()["tracker_key"]
    assert len(set(keys.values())) == 1
    path = f"/v1/route?model={MODEL}&start_layer=2&end_layer=3&session=s1"

    resp = await tracker.get(path, headers=signed("entry", "GET", path))
    assert resp.status_code == 200, resp.text
    claims = read_ticket(resp.json()["ticket"], decode_public_key(keys["c"]))
    assert (claims.session, claims.model, claims.entry, claims.entry_key) == ("s1", MODEL, "entry", public_key("entry"))
    assert [(h.node_id, h.start_layer, h.end_layer) for h in claims.hops] == [("c", 2, 3)]
    assert 0 < claims.expires_at - claims.issued_at <= 600

    assert (await tracker.get(path)).status_code == 401                                   # unsigned
    assert (await tracker.get(path, headers=signed("c", "GET", path))).json()["error"]["code"] == "not_an_entry"
    taken = await tracker.get(path, headers=signed("other-entry", "GET", path))
    assert taken.status_code == 403 and taken.json()["error"]["code"] == "session_taken"
    plain = await tracker.get(f"/v1/route?model={MODEL}&start_layer=2&end_layer=3")
    assert plain.status_code == 200 and "ticket" not in plain.json()  # no session: no ticket, no signature needed
