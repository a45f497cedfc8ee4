"""``GET /v1/traffic`` on the node and the tracker, and the entry's traffic log during a failover
(ADR-0046). Real node apps over ASGI with the tiny seeded model."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from asgi_lifespan import LifespanManager

from meshnet.errors import NotFound
from meshnet.dataplane.failover import MeshLink
from meshnet.dataplane.chain import ChainEnd
from meshnet.gateway.pipeline import GenerationStats, Orchestrator, OrchestratorSettings
from meshnet.gateway.traffic import TrafficLog
from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from meshnet.node.entry import LocalEntry
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from meshnet.protocol.openai import SamplingParams
from meshnet.protocol.route import Hop, Route as MeshRoute
from meshnet.protocol.traffic import BUCKET_COUNT, MeshTraffic, NodeTraffic
from meshnet.tracker.app import build_app as build_tracker
from meshnet.tracker.service import TrackerSettings
from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, registration

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello mesh"}], "max_tokens": 5,
        "temperature": 0}
BAD_URL = "http://::1:8821"  # an unbracketed IPv6 endpoint: every call to it fails at once


@pytest.fixture(scope="module")
def full_runtime(tiny_model_path) -> NodeRuntime:
    rt = NodeRuntime(max_loaded_shards=1, compute_dtype="float32")
    rt.load(MODEL, tiny_model_path(MODEL), LayerRange(0, 4))
    return rt


async def test_a_node_reports_its_sessions_buckets_and_batch_sizes(asgi_client, full_runtime):
    node = await asgi_client(build_app(NodeSettings(node_id="n1", port=1, wire_dtype="float32"),
                                       runtime=full_runtime), "http://n1")
    resp = await node.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    body = (await node.get("/v1/traffic")).json()
    traffic = NodeTraffic.model_validate(body)
    assert (traffic.node_id, traffic.sessions, traffic.kv_sessions, traffic.failovers, traffic.error) == \
        ("n1", [], 0, [], None)
    assert len(traffic.buckets) == BUCKET_COUNT and traffic.bucket_s == 10.0
    assert traffic.buckets[-1].start_s <= traffic.at_s < traffic.buckets[-1].start_s + 10.0
    recent = [b for b in traffic.buckets[-2:] if b.forward_tokens]  # the chat may straddle a bucket edge
    assert sum(b.first_tokens for b in recent) == 1
    assert sum(b.forward_tokens for b in recent) == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert {b.batch_size for b in recent} == {1.0} and {b.batch_size_max for b in recent} == {1}
    assert any(b.ttft_s and b.ttft_s > 0 for b in recent) and any(b.tpot_s and b.tpot_s > 0 for b in recent)


@pytest.fixture
async def split_mesh(tiny_model_path):
    """``(entry runtime, client reaching http://c)``: the entry holds [0, 2), node c [2, 4)."""
    path = tiny_model_path(MODEL)
    entry, c = NodeRuntime(), NodeRuntime()
    entry.load(MODEL, path, LayerRange(0, 2))
    c.load(MODEL, path, LayerRange(2, 4))
    app = build_app(NodeSettings(node_id="c", port=1), runtime=c)
    async with LifespanManager(app):
        async with httpx.AsyncClient(mounts={"http://c": httpx.ASGITransport(app=app)}) as client:
            yield entry, client


async def test_the_traffic_log_follows_a_session_through_its_failover(split_mesh):
    entry, client = split_mesh

    async def routes(model, layers, exclude, session_id):
        for name in ("bad", "c"):
            if name not in exclude:
                return MeshRoute([Hop(name, BAD_URL if name == "bad" else f"http://{name}", layers)])
        raise NotFound("no node", code="model_loading")

    async def report(node_id, reason, ticket=None):
        pass

    log = TrafficLog("entry", clock=lambda: 1000.0)
    slot = next(iter(entry.slots.values()))
    orch = Orchestrator(LocalEntry(entry, slot, wire_dtype="float32"), end=ChainEnd("entry", "http://entry"),
                        link=MeshLink(client, routes, report), traffic=log,
                        settings=OrchestratorSettings(chunk_tokens=8))
    stats, seen = GenerationStats(), []
    async for _ in orch.generate(list(range(3, 20)), SamplingParams(max_tokens=4), stats):
        seen.append(log.sessions())
    assert len(seen) == 4 and all(len(s) == 1 for s in seen)
    first, last = seen[0][0], seen[-1][0]
    assert [(h.node_id, h.start_layer, h.end_layer) for h in last.route] == [("entry", 0, 1), ("c", 2, 3)]
    assert (first.completion_tokens, last.completion_tokens, last.prompt_tokens, last.failovers) == (1, 4, 17, 1)
    [event] = log.failovers()
    assert (event.session_id, event.entry_node, event.failed_node, event.replacement) == \
        (last.session_id, "entry", "bad", ["c"])
    assert (event.start_layer, event.end_layer, event.at_s) == (2, 3, 1000.0)
    assert event.reason == "hop bad at http://::1:8821 (layers 2-3) failed: InvalidURL: Invalid port: ':1:8821'"
    assert log.sessions() == [] and stats.failovers == 1


class NodeNetwork(httpx.AsyncBaseTransport):
    """The tracker's outbound calls: ``http://n1`` is a real node app, ``http://slow`` never answers
    a traffic call in time, every other host is refused; ``calls`` counts traffic calls per host."""

    def __init__(self, n1) -> None:
        self.n1 = httpx.ASGITransport(app=n1)
        self.calls: dict[str, int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/traffic":
            self.calls[host] = self.calls.get(host, 0) + 1
        if host == "n1":
            return await self.n1.handle_async_request(request)
        if host == "slow":
            await asyncio.sleep(30)
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


async def test_the_tracker_gathers_every_nodes_traffic_and_caches_it(asgi_client, full_runtime):
    n1 = build_app(NodeSettings(node_id="n1", port=1, wire_dtype="float32"), runtime=full_runtime)
    network = NodeNetwork(n1)
    async with LifespanManager(n1):
        app = build_tracker(TrackerSettings(models=(MODEL,), db_path=":memory:", admission_challenges=False), run_loop=False,
                            transport=HealthyNodes(network))
        tracker = await asgi_client(app, "http://tracker", auth=SignAsNodes())
        shard = {"model": MODEL, "shard_start": 0, "shard_end": 3, "entry": True,
                 "report": capability_report(MODEL, 0, 3)}
        for node_id, endpoint in [("n1", "http://n1"), ("n2", "http://n2"), ("n3", "http://slow")]:
            resp = await tracker.post("/v1/nodes/register", json=registration(node_id, endpoint, shards=[shard]))
            assert resp.status_code == 200, resp.text
        app.state.traffic.node_timeout_s = 0.3
        body = (await tracker.get("/v1/traffic")).json()
        traffic = MeshTraffic.model_validate(body)
        assert [n.node_id for n in traffic.nodes] == ["n1", "n2", "n3"]
        ok, refused, slow = traffic.nodes
        assert ok.error is None and len(ok.buckets) == BUCKET_COUNT
        assert refused.error.startswith("GET http://n2/v1/traffic ConnectError") and refused.buckets == []
        assert slow.error == "GET http://slow/v1/traffic timed out"
        assert (traffic.sessions, traffic.failovers) == ([], [])
        assert (await tracker.get("/v1/traffic")).json() == body  # within the cache: the nodes are not asked again
        short = (await tracker.get("/v1/traffic", params={"buckets": 6})).json()
        assert [len(n["buckets"]) for n in short["nodes"]] == [6, 0, 0]
        assert short["nodes"][0]["buckets"] == body["nodes"][0]["buckets"][-6:]
        assert network.calls == {"n1": 1, "n2": 1, "slow": 1}
        for bad in ("0", "61", "x"):
            resp = await tracker.get("/v1/traffic", params={"buckets": bad})
            assert resp.status_code == 422 and "buckets" in resp.json()["error"]["message"]


async def test_session_ids_are_shown_only_to_the_tracker_and_the_operator(asgi_client, full_runtime):
    """ADR-0049: a session id names the session in tickets, releases and health probes, so a node
    shows it only to a call its tracker signed, and the tracker only to the operator; everyone else
    sees the session's alias, the same on every view."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshnet.protocol.signing import TRACKER_SIGNER, sign_request
    from meshnet.protocol.traffic import session_alias

    session = "ab" * 16
    n1 = build_app(NodeSettings(node_id="n1", port=1, wire_dtype="float32"), runtime=full_runtime)
    app = build_tracker(TrackerSettings(models=(MODEL,), db_path=":memory:", admission_challenges=False,
                                        operator_token="op-secret"),
                        run_loop=False, transport=HealthyNodes(NodeNetwork(n1)))
    tracker = await asgi_client(app, "http://tracker", auth=SignAsNodes())
    tracker_key = app.state.service.tickets.key
    direct = await asgi_client(n1, "http://n1")
    node = n1.state.node
    node.tracker_key = tracker_key.public_key()
    node.traffic.session_started(session, MODEL, GenerationStats(prompt_tokens=3), lambda: [])

    def signed(key) -> dict[str, str]:
        return sign_request(key, TRACKER_SIGNER, "GET", "/v1/traffic", b"")

    async def ids(client, headers=None) -> list[str]:
        resp = await client.get("/v1/traffic", headers=headers)
        assert resp.status_code == 200, resp.text
        return [s["session_id"] for s in resp.json()["sessions"]]

    assert session_alias(session).startswith("s-") and len(session_alias(session)) == 14
    assert await ids(direct) == [session_alias(session)]
    assert await ids(direct, signed(Ed25519PrivateKey.generate())) == [session_alias(session)]  # not the tracker
    assert await ids(direct, signed(tracker_key)) == [session]

    shard = {"model": MODEL, "shard_start": 0, "shard_end": 3, "entry": True,
             "report": capability_report(MODEL, 0, 3)}
    resp = await tracker.post("/v1/nodes/register", json=registration("n1", "http://n1", shards=[shard]))
    assert resp.status_code == 200, resp.text
    assert await ids(tracker) == [session_alias(session)]
    assert await ids(tracker, {"Authorization": "Bearer wrong"}) == [session_alias(session)]
    assert await ids(tracker, {"Authorization": "Bearer op-secret"}) == [session]  # the tracker's call was signed
    node.traffic.session_ended(session)


async def test_doctor_runs_on_a_node_only_when_its_tracker_asks(asgi_client, full_runtime):
    """A doctor run is a forward pass per shard: an unsigned call, or one signed by another key, is
    a 401 and runs nothing; the operator's doctor through the tracker (which signs) runs it."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshnet.protocol.signing import TRACKER_SIGNER, sign_request

    n1 = build_app(NodeSettings(node_id="n1", port=1, wire_dtype="float32"), runtime=full_runtime)
    app = build_tracker(TrackerSettings(models=(MODEL,), db_path=":memory:", admission_challenges=False,
                                        operator_token="op-secret"),
                        run_loop=False, transport=HealthyNodes(NodeNetwork(n1)))
    tracker = await asgi_client(app, "http://tracker", auth=SignAsNodes())
    direct = await asgi_client(n1, "http://n1")
    n1.state.node.tracker_key = app.state.service.tickets.key.public_key()
    reports = n1.state.node.reports  # every doctor run keeps its reports here
    reports.clear()
    for headers in (None, sign_request(Ed25519PrivateKey.generate(), TRACKER_SIGNER, "POST", "/v1/doctor", b"")):
        resp = await direct.post("/v1/doctor", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "tracker_only"
    assert reports == {}
    shard = {"model": MODEL, "shard_start": 0, "shard_end": 3, "entry": True,
             "report": capability_report(MODEL, 0, 3)}
    assert (await tracker.post("/v1/nodes/register", json=registration("n1", "http://n1", shards=[shard]))).status_code == 200
    resp = await tracker.post("/v1/operator/doctor", json={"node_id": "n1"}, headers={"Authorization": "Bearer op-secret"})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["reports"]) == len(reports) == 1
