"""Chains of hop streams between real node apps (ADR-0040), tiny seeded model, float32.

Each node app runs under uvicorn in this test's event loop on a free 127.0.0.1 port (streams
are WebSockets, which need real sockets): the entry holds layers [0, 2), ``b`` [2, 3), ``c``
and ``c2`` [3, 4). The orchestrator drives the entry node's own runtime and stream pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import time

import httpx
import pytest
import torch
import uvicorn

from meshnet.node import wire
from meshnet.endpoints import free_port
from meshnet.errors import HopFailed, NotFound
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

MODEL = "tiny-llama"
PROMPT = list(range(3, 40))
SHARDS = {"entry": (0, 2), "b": (2, 3), "c": (3, 4), "c2": (3, 4)}


@contextlib.asynccontextmanager
async def serving(app, port: int):
    """``app`` under uvicorn on 127.0.0.1:``port`` in this loop until the block ends (start bounded to 10 s)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(1000):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started, "uvicorn did not start within 10 s"
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)


@pytest.fixture
async def nodes(tiny_model_path):
    """``{name: (endpoint, node context)}`` of four running node apps."""
    path = tiny_model_path(MODEL)
    async with contextlib.AsyncExitStack() as stack:
        out = {}
        for name, (a, b) in SHARDS.items():
            rt = NodeRuntime(compute_dtype="float32")
            rt.load(MODEL, path, LayerRange(a, b))
            port = free_port()
            app = build_app(NodeSettings(node_id=name, port=port, wire_dtype="float32"), runtime=rt)
            await stack.enter_async_context(serving(app, port))
            out[name] = (f"http://127.0.0.1:{port}", app.state.node)
        yield out


#: layers of every name a route may use: the running nodes plus ghosts at ports nobody listens on
LAYERS = {**SHARDS, "b0": (2, 3), "ghost": (3, 4)}


def routes_over(nodes, *chains: list[str], calls: list | None = None):
    """Route provider: the first chain of node names with none excluded (a ghost's endpoint is a
    free port: nothing listens there)."""
    dead = f"http://127.0.0.1:{free_port()}"

    async def routes(model, layers, exclude, session_id):
        if calls is not None:
            calls.append(set(exclude))
        for names in chains:
            if not set(names) & exclude:
                return Route([Hop(n, nodes[n][0] if n in nodes else dead, LayerRange(*LAYERS[n])) for n in names])
        raise NotFound(f"no route over layers {layers}", code="model_loading")
    return routes


def orchestrator(nodes, routes, reported: list | None = None, chain: bool = True,
                 client: httpx.AsyncClient | None = None, speculate: int | None = 0) -> Orchestrator:
    """The entry's orchestrator over ``routes``; one decode token per step unless ``speculate``
    (the failure tests here spoil the step at a given position)."""
    endpoint, node = nodes["entry"]

    async def report(node_id, reason, ticket=None):
        if reported is not None:
            reported.append(node_id)

    slot = next(iter(node.runtime.slots.values()))
    return Orchestrator(LocalEntry(node.runtime, slot, wire_dtype="float32"),
                        end=ChainEnd("entry", endpoint, node.streams, node.inbox),
                        link=MeshLink(client or node.http, routes, report),
                        settings=OrchestratorSettings(chunk_tokens=8, chain=chain, speculate=speculate))


async def generate(orch, max_tokens: int = 6) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    tokens = [t async for t in orch.generate(PROMPT, SamplingParams(max_tokens=max_tokens), stats)]
    return tokens, stats


def monolithic(tiny_hf_model, max_tokens: int = 6) -> list[int]:
    model = tiny_hf_model(MODEL)
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


async def sessions_left(nodes, names) -> dict[str, int]:
    await settle_releases(5.0)
    return {n: len(nodes[n][1].runtime.sessions) + len(nodes[n][1].chains) for n in names}


async def test_a_chain_of_hop_streams_gives_the_monolithic_greedy_tokens_and_reuses_its_connections(
        nodes, tiny_hf_model):
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]))
    got, stats = await generate(orch)
    assert got == monolithic(tiny_hf_model)
    assert [h.node_id for h in stats.route] == ["entry", "b", "c"] and stats.failovers == 0
    pools = {n: nodes[n][1].streams.opened for n in ("entry", "b", "c")}
    assert pools == {"entry": 1, "b": 1, "c": 1}  # entry → b, b → c, c → entry (the direct return)
    again, _ = await generate(orch)
    assert again == got
    assert {n: nodes[n][1].streams.opened for n in ("entry", "b", "c")} == pools  # the second session reused them
    assert await sessions_left(nodes, ["entry", "b", "c"]) == {"entry": 0, "b": 0, "c": 0}
    assert len(nodes["entry"][1].inbox) == 0


async def test_the_chain_equals_the_http_fallback(nodes):
    routes = routes_over(nodes, ["b", "c"])
    chained, _ = await generate(orchestrator(nodes, routes), 8)
    star, _ = await generate(orchestrator(nodes, routes, chain=False), 8)
    assert chained == star and len(chained) == 8


async def test_an_unreachable_first_hop_is_reported_and_the_chain_replaced(nodes, tiny_hf_model):
    reported, calls = [], []
    got, stats = await generate(orchestrator(nodes, routes_over(nodes, ["b0", "c"], ["b", "c"], calls=calls),
                                             reported))
    assert got == monolithic(tiny_hf_model)
    assert reported == ["b0"] and calls == [set(), {"b0"}] and stats.failovers == 1
    assert [h.node_id for h in stats.route] == ["entry", "b", "c"]


async def test_a_hop_that_cannot_reach_its_next_hop_names_it_and_the_chain_goes_around_it(nodes, tiny_hf_model):
    reported, calls = [], []
    routes = routes_over(nodes, ["b", "ghost"], ["b", "c2"], calls=calls)
    got, stats = await generate(orchestrator(nodes, routes, reported))
    assert got == monolithic(tiny_hf_model)
    assert reported == ["ghost"]  # b told the entry which hop it could not reach
    assert calls == [set(), {"ghost"}]
    assert [h.node_id for h in stats.route] == ["entry", "b", "c2"] and stats.failovers == 1
    assert await sessions_left(nodes, ["b", "c2"]) == {"b": 0, "c2": 0}


#: RESULT bodies a last hop must not send: one that does not decode, one of the wrong shape
UNUSABLE = {"garbage": b"not a frame", "narrow": wire.encode(torch.zeros(1, 1, 1), dtype="float32")}


def spoil_once(monkeypatch, nodes, name: str, last_hop: bool, position: int, frame: bytes) -> list[str]:
    """Node ``name`` sends ``frame`` instead of its output once: the first output at ``position`` it
    sends as the last hop (a RESULT) or, with ``last_hop`` False, to a next hop (a STEP). Returns
    the ids of the chains spoiled (one, once it happened)."""
    host = nodes[name][1].chains
    real_send_output, spoiled = host._send_output, []

    async def spoiling(chain, message, out):
        if (chain.next_hop is None) == last_hop and message.position == position and not spoiled:
            spoiled.append(chain.chain_id)
            out = frame
        return await real_send_output(chain, message, out)

    monkeypatch.setattr(host, "_send_output", spoiling)
    return spoiled


async def fails_over_from_c_to_c2(nodes, tiny_hf_model, spoiled: list[str]) -> None:
    """A generation over ``b`` then ``c`` whose fault (spoiled once) is blamed on ``c``: ``c`` is
    excluded and reported, the chain goes through ``c2``, and the tokens are unchanged."""
    reported, calls = [], []
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"], ["b", "c2"], calls=calls), reported)
    got, stats = await asyncio.wait_for(generate(orch), timeout=60)
    assert len(spoiled) == 1
    assert got == monolithic(tiny_hf_model)
    assert reported == ["c"] and calls == [set(), {"c"}] and stats.failovers == 1
    assert [h.node_id for h in stats.route] == ["entry", "b", "c2"]


@pytest.mark.parametrize(("bad", "position"), [("garbage", 8), ("narrow", len(PROMPT) + 1)])
async def test_an_unusable_result_fails_the_last_hop_and_the_chain_over(nodes, tiny_hf_model, monkeypatch, bad,
                                                                        position):
    """``c`` sends an unusable RESULT once, for a prefill chunk (later chunks are in flight) or for a
    decode step: it is excluded and reported, the chain goes through ``c2``, the tokens are unchanged."""
    spoiled = spoil_once(monkeypatch, nodes, "c", True, position, UNUSABLE[bad])
    await fails_over_from_c_to_c2(nodes, tiny_hf_model, spoiled)
    assert await sessions_left(nodes, ["b", "c", "c2"]) == {"b": 0, "c": 0, "c2": 0}


async def test_an_unreadable_step_frame_blames_the_hop_that_sent_it(nodes, monkeypatch):
    """``b`` pushes a STEP frame ``c`` cannot decode: ``c`` names ``b`` in its ERROR, so ``b`` (not
    the honest receiver) is excluded and reported; with no other holder of ``b``'s layers the
    generation ends with a clear error."""
    spoiled = spoil_once(monkeypatch, nodes, "b", False, len(PROMPT), UNUSABLE["garbage"])
    reported, calls = [], []
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"], calls=calls), reported)
    with pytest.raises(HopFailed, match=r"c received an unreadable frame from b.*no other route"):
        await asyncio.wait_for(generate(orch), timeout=60)
    assert len(spoiled) == 1 and reported == ["b"] and calls == [set(), {"b"}]
    assert await sessions_left(nodes, ["b", "c"]) == {"b": 0, "c": 0}


async def test_an_error_the_entry_cannot_read_blames_the_hop_that_sent_it(nodes, tiny_hf_model, monkeypatch):
    """``c`` reports a step failure in an ERROR whose body does not parse: its place in the chain,
    in the message header, still names it, so ``c`` is excluded and reported, the chain goes
    through ``c2``, and the tokens are unchanged."""
    from meshnet.node import wire as node_streams

    class Garbled(node_streams.ChainError):
        def to_body(self) -> bytes:
            return b"\xffnot json"

    monkeypatch.setattr(node_streams, "ChainError", Garbled)
    spoiled = spoil_once(monkeypatch, nodes, "b", False, len(PROMPT), UNUSABLE["garbage"])  # c sends an ERROR
    await fails_over_from_c_to_c2(nodes, tiny_hf_model, spoiled)


async def test_a_last_hop_that_cannot_reach_the_entry_is_found_by_the_probe_and_replaced(nodes, tiny_hf_model,
                                                                                       monkeypatch):
    """``c`` cannot return one decode step's RESULT (the entry unreachable from it) and drops the
    chain, with nobody to tell: at the step's deadline the probe finds ``c`` alive without the
    chain, and the chain goes through ``c2`` in about a second (not the 60 s hop timeout); ``c``
    is kept out of the new chain but not reported, and the tokens are unchanged."""
    host = nodes["c"][1].chains
    real_send_output, lost = host._send_output, []

    async def unreachable_entry(chain, message, frame):
        if chain.next_hop is None and message.position == len(PROMPT) + 2 and not lost:
            lost.append(chain.chain_id)
            return False
        return await real_send_output(chain, message, frame)

    monkeypatch.setattr(host, "_send_output", unreachable_entry)
    reported, calls = [], []
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"], ["b", "c2"], calls=calls), reported)
    t0 = time.monotonic()
    got, stats = await asyncio.wait_for(generate(orch), timeout=30)
    assert time.monotonic() - t0 < 10
    assert len(lost) == 1 and lost[0] not in host.chains
    assert got == monolithic(tiny_hf_model)
    assert reported == [] and calls == [set(), {"c"}] and stats.failovers == 1 and stats.deadline_misses == 0
    assert [h.node_id for h in stats.route] == ["entry", "b", "c2"]
    assert await sessions_left(nodes, ["b", "c", "c2"]) == {"b": 0, "c": 0, "c2": 0}


class SilentHealth(httpx.AsyncBaseTransport):
    """The network, except that ``GET /v1/health`` of ``port`` never answers (a stopped process)."""

    def __init__(self, port: int) -> None:
        self.inner, self.port = httpx.AsyncHTTPTransport(), port

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.port == self.port and request.url.path == "/v1/health":
            await asyncio.sleep(30)
        return await self.inner.handle_async_request(request)


async def test_a_frozen_last_hop_misses_the_deadline_and_the_session_moves(nodes, tiny_hf_model):
    """``c`` stops computing at its fourth step and its health stops answering (as under SIGSTOP):
    the entry's deadline passes, the probe gets no answer, the chain is rebuilt through ``c2``
    with the history replayed as chunks; the tokens are unchanged."""
    c = nodes["c"][1]
    real_forward, steps, release = c.runtime.forward_async, [], asyncio.Event()

    async def freezing(**kw):
        steps.append(kw["position"])
        if len(steps) > 3:
            await asyncio.wait_for(release.wait(), timeout=30)
        return await real_forward(**kw)

    c.runtime.forward_async = freezing
    reported = []
    port = int(nodes["c"][0].rsplit(":", 1)[1])
    try:
        async with httpx.AsyncClient(transport=SilentHealth(port)) as client:
            orch = orchestrator(nodes, routes_over(nodes, ["b", "c"], ["b", "c2"]), reported, client=client)
            t0 = time.perf_counter()
            got, stats = await asyncio.wait_for(generate(orch, 8), timeout=60)
            elapsed = time.perf_counter() - t0
    finally:
        release.set()
        c.runtime.forward_async = real_forward
    assert got == monolithic(tiny_hf_model, 8)
    assert stats.deadline_misses == 1 and stats.failovers == 1 and reported == ["c"]
    assert [h.node_id for h in stats.route] == ["entry", "b", "c2"]
    assert elapsed < 10


def ticketed(nodes, *chains: list[str], issuer, bad_for: str | None = None):
    """Route provider with the tracker's tickets (``bad_for``: in the first route, the ticket names
    that node for other layers, so it must refuse the chain)."""
    from tests.payloads import public_key

    async def routes(model, layers, exclude, session_id):
        for names in chains:
            if not set(names) & exclude:
                hops = [Hop(n, nodes[n][0], LayerRange(*LAYERS[n])) for n in names]
                named = [Hop(h.node_id, h.endpoint, LayerRange(0, 1)) if h.node_id == bad_for else h for h in hops]
                ticket = issuer.issue(session=session_id, model=model, entry="entry", entry_key=public_key("entry"),
                                      hops=named)
                return Route(hops, ticket)
        raise NotFound(f"no route over layers {layers}", code="model_loading")
    return routes


async def test_a_hop_checks_its_ticket_at_open_and_one_that_does_not_cover_it_is_routed_around(nodes, tiny_hf_model):
    from meshnet.client import NodeSigner
    from meshnet.tracker.tickets import TicketIssuer
    from tests.payloads import node_key

    tracker = node_key("tracker")
    for name in ("b", "c", "c2"):
        nodes[name][1].tracker_key = tracker.public_key()
    reported = []
    orch = orchestrator(nodes, ticketed(nodes, ["b", "c"], ["b", "c2"], issuer=TicketIssuer(tracker), bad_for="c"),
                        reported)
    orch.link = dataclasses.replace(orch.link, release_auth=NodeSigner("entry", node_key("entry")))
    got, stats = await generate(orch)
    assert got == monolithic(tiny_hf_model)
    assert reported == ["c"] and stats.failovers == 1  # c answered 403 ticket_scope at OPEN
    assert nodes["c"][1].runtime.tokens_processed == 0  # before any KV cache was touched
    assert [h.node_id for h in stats.route] == ["entry", "b", "c2"]
    assert await sessions_left(nodes, ["b", "c2"]) == {"b": 0, "c2": 0}  # releases signed by the entry


def record_stream(port: int, reads_bundles: bool, received: list[bytes]):
    """A peer on ``port`` that records every stream message; it accepts the bundle subprotocol
    when offered only where ``reads_bundles`` (a node from before bundles accepts none)."""
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute

    from meshnet.dataplane.frames import READS_BUNDLES

    async def record(websocket):
        offered = websocket.scope.get("subprotocols", [])
        await websocket.accept(subprotocol=READS_BUNDLES if reads_bundles and READS_BUNDLES in offered else None)
        with contextlib.suppress(Exception):
            while True:
                received.append(await websocket.receive_bytes())

    return serving(Starlette(routes=[WebSocketRoute("/v1/stream", record)]), port)


@pytest.mark.parametrize("reads_bundles", [True, False])
async def test_messages_sent_to_one_peer_in_one_turn_leave_as_one_bundle_where_it_reads_them(reads_bundles):
    from meshnet.dataplane.transport import PeerUnreachable, StreamPool
    from meshnet.dataplane.frames import Kind, pack, unbundle, unpack

    received: list[bytes] = []
    port = free_port()
    steps = [pack(Kind.STEP, "ab" * 16, position=p, body=b"x" * p) for p in (1, 2, 3)]
    pool = StreamPool()
    want = 2 if reads_bundles else 4
    async with record_stream(port, reads_bundles, received), asyncio.timeout(30):
        endpoint = f"http://127.0.0.1:{port}"
        await asyncio.gather(*(pool.send(endpoint, step) for step in steps))  # one turn of the loop
        await pool.send(endpoint, steps[0])  # alone
        for _ in range(500):
            if len(received) == want:
                break
            await asyncio.sleep(0.01)
        await pool.close()
    assert pool.written == want and len(received) == want
    if reads_bundles:
        assert unpack(received[0]).kind == Kind.BUNDLE and unbundle(unpack(received[0])) == steps
    else:  # each alone, in order: a node from before bundles would drop a bundle as an unknown kind
        assert received[:3] == steps
    assert received[-1] == steps[0]

    nobody = StreamPool(connect_timeout_s=1.0)
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    async with asyncio.timeout(30):
        errors = await asyncio.gather(*(nobody.send(dead, s) for s in steps[:2]), return_exceptions=True)
    assert all(isinstance(e, PeerUnreachable) for e in errors) and errors[0] is not errors[1]  # one error each
    await nobody.close()


async def test_a_node_accepts_the_bundle_subprotocol_only_when_offered(nodes):
    from websockets.asyncio.client import connect

    from meshnet.dataplane.frames import READS_BUNDLES, stream_url

    url = stream_url(nodes["b"][0])
    async with asyncio.timeout(30):
        async with connect(url, subprotocols=["meshnet-stream.future", READS_BUNDLES], proxy=None) as offered:
            assert offered.subprotocol == READS_BUNDLES
        async with connect(url, proxy=None) as older:  # an opener from before bundles offers none
            assert older.subprotocol is None


async def test_a_node_handles_each_message_of_a_bundle_as_if_it_came_alone(nodes, tiny_hf_model):
    from meshnet.dataplane.frames import Kind, bundle, pack

    _, node = nodes["b"]
    delivered = []
    node.inbox.deliver = lambda message: delivered.append((message.kind, message.position)) or True
    results = [pack(Kind.RESULT, "cd" * 16, position=p, body=b"frame") for p in (7, 8)]
    await node.chains.dispatch(bundle(results))
    await node.chains.dispatch(bundle([b"short"]))  # a bad message inside: dropped alone, logged
    assert delivered == [(Kind.RESULT, 7), (Kind.RESULT, 8)]


async def test_messages_without_the_chain_key_are_dropped_at_the_entry_and_at_a_hop(nodes, tiny_hf_model):
    """ADR-0049: an outsider who knows a chain's id (it names the session in tickets, releases and
    the operator's views) but not its key can neither fail the chain with an ERROR, nor answer for
    it with a RESULT, nor feed a hop a STEP: the generation is the monolithic one, nobody is
    reported, and the hop ran exactly the chain's own tokens."""
    from websockets.asyncio.client import connect

    from meshnet.dataplane.frames import ChainError, Kind, pack, stream_url

    reported: list[str] = []
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]), reported)
    hidden = next(iter(nodes["c"][1].runtime.slots.values())).shard.config.hidden_size
    junk = wire.encode(torch.full((1, 1, hidden), 7.0), dtype="float32")
    error = ChainError(node_id="b", code="forward_failed", message="forged", status=502).to_body()
    stats, got = GenerationStats(), []
    async with asyncio.timeout(60):
        async for token in orch.generate(PROMPT, SamplingParams(max_tokens=6), stats):
            got.append(token)
            if len(got) != 2:
                continue
            (chain_id,) = nodes["c"][1].chains.chains  # the id the outsider learnt
            positions = range(len(PROMPT), len(PROMPT) + 8)
            async with connect(stream_url(nodes["entry"][0]), proxy=None) as ws:
                for position in positions:
                    await ws.send(pack(Kind.RESULT, chain_id, position=position, hop_index=2, body=junk))
                await ws.send(pack(Kind.ERROR, chain_id, hop_index=1, body=error))
            async with connect(stream_url(nodes["c"][0]), proxy=None) as ws:
                for position in positions:
                    await ws.send(pack(Kind.STEP, chain_id, position=position, hop_index=1, body=junk))
            await asyncio.sleep(0.2)  # the forged messages were read before the next step goes out
    assert got == monolithic(tiny_hf_model)
    assert reported == [] and stats.failovers == 0
    assert nodes["c"][1].runtime.tokens_processed == len(PROMPT) + 5  # the prompt and five decode steps, no more
    assert await sessions_left(nodes, ["entry", "b", "c"]) == {"entry": 0, "b": 0, "c": 0}


def auditing(nodes, routes, witnesses, reported: list | None = None, chain: bool = True) -> Orchestrator:
    """:func:`orchestrator` whose entry audits every session (ADR-0067) with ``witnesses`` (node
    names) as the other holders of their layers; disputes would go to a list (none expected here)."""
    from meshnet.gateway.audit import Auditor
    from tests.payloads import node_key

    for name, (_, node) in nodes.items():  # each hop signs its steps (a node's key comes from its agent)
        node.step_key = node_key(name)
    orch = orchestrator(nodes, routes, reported, chain=chain)
    disputes = []

    async def report(node_id, report):
        disputes.append((node_id, report))
        return {"verdict": "none"}

    async def witness_routes(model, layers, exclude, session, audited):
        names = [n for n in witnesses if LayerRange(*LAYERS[n]) == layers and n not in exclude]
        if not names:
            raise NotFound(f"no other holder of layers {layers}", code="model_loading")
        return Route([Hop(names[0], nodes[names[0]][0], layers)])

    orch.audit = Auditor(1.0, client=nodes["entry"][1].http, routes=witness_routes, report=report)
    orch.disputes = disputes
    return orch


async def test_a_failed_over_chain_is_audited_from_its_replay_on(nodes, tiny_hf_model):
    """The replacement chain's first steps replay the history: the entry keeps what it sent then
    too, so its hops are audited like any chain's (c against its witness c2; b has no other holder)."""
    orch = auditing(nodes, routes_over(nodes, ["b0", "c"], ["b", "c"]), ["c2"])
    got, stats = await generate(orch)
    await orch.audit.drain()
    assert got == monolithic(tiny_hf_model) and stats.failovers == 1
    audits = orch.audit.stats
    assert (audits.audits, audits.passed, audits.unverified, audits.withheld, audits.mismatched) == (2, 1, 1, 0, 0)
    assert len(audits.distances) == 1 and audits.distances[0] < 1e-5 and orch.disputes == []  # float32 chunkings


async def test_a_hop_that_keeps_no_transcript_is_audited_on_its_neighbours_frames(nodes, tiny_hf_model, monkeypatch):
    """c (the last hop) answers every transcript request with nothing: its receipts name the frames
    b sent it (b's transcript) and the results the entry got; rebuilt from those, it is audited
    against its witness c2 and passes. b, whose transcript c would have given, is audited as ever."""
    monkeypatch.setattr(nodes["c"][1].transcripts, "steps", lambda chain_id, key: None)
    orch = auditing(nodes, routes_over(nodes, ["b", "c"]), ["c2"])
    got, _ = await generate(orch)
    await orch.audit.drain()
    assert got == monolithic(tiny_hf_model)
    audits = orch.audit.stats
    assert (audits.audits, audits.withheld, audits.rebuilt, audits.passed, audits.unverified) == (2, 1, 1, 1, 1)
    assert len(audits.distances) == 1 and audits.distances[0] < 1e-5 and orch.disputes == []  # float32 chunkings


async def test_sessions_on_the_http_hop_path_are_audited_on_the_entrys_own_record(nodes, tiny_hf_model, monkeypatch):
    """With hop streams off the entry sends each hop its frames itself: an audit replays what it
    recorded (no transcript to fetch). c lies on every decode step (noise on its output past the
    prompt): the audit measures it far from its witness c2 and sends the tracker c's own signed
    steps, up to the first far one, under the ticket that routed it."""
    from meshnet.node.runtime import NodeRuntime

    honest = NodeRuntime.forward_async
    liar = nodes["c"][1].runtime

    async def lying(self, *, position, hidden, **kw):
        out = await honest(self, position=position, hidden=hidden, **kw)
        return out + 0.5 * out.std() if self is liar and position >= len(PROMPT) else out

    monkeypatch.setattr(NodeRuntime, "forward_async", lying)
    plain = routes_over(nodes, ["b", "c"])

    async def ticketed(model, layers, exclude, session_id):  # these nodes know no tracker: any ticket passes
        return Route((await plain(model, layers, exclude, session_id)).hops, ticket=f"ticket-of-{session_id}")

    orch = auditing(nodes, ticketed, ["c2"], chain=False)
    await generate(orch)
    await orch.audit.drain()
    audits = orch.audit.stats
    assert (audits.audits, audits.unverified, audits.withheld, audits.mismatched, audits.disputes) == (2, 1, 0, 0, 1)
    (accused, report), = orch.disputes
    assert accused == "c" and report.ticket == f"ticket-of-{report.chain_id}" and len(report.steps) >= 2
    assert report.steps[0].position == 0 and report.steps[-1].position >= len(PROMPT)  # up to its first lie
    assert max(audits.distances) > orch.audit.limit


async def test_an_honest_session_on_the_http_hop_path_passes_its_audit(nodes, tiny_hf_model):
    orch = auditing(nodes, routes_over(nodes, ["b", "c"]), ["c2"], chain=False)
    got, _ = await generate(orch)
    await orch.audit.drain()
    assert got == monolithic(tiny_hf_model)
    audits = orch.audit.stats
    assert (audits.audits, audits.passed, audits.unverified, audits.withheld, audits.disputes) == (2, 1, 1, 0, 0)
    assert audits.distances[0] < 1e-5
