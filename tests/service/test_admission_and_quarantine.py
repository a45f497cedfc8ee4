"""Admission by evidence and quarantine (ADR-0042), tracker in-process.

Fake nodes answer hop calls with a fixed function of their input (``tanh``), so honest
holders agree exactly; a dishonest one adds noise. The tracker challenges a second holder of
a range against the first, judges an entry's audit by re-running the accused's own signed steps
on two holders it picks (ADR-0067), keeps a quarantined node out of routes, and lets an operator
reinstate it.
"""

from __future__ import annotations

import asyncio
import json
import struct
import uuid

import httpx
import numpy as np
import pytest

from meshnet.dataplane.frames import read_array as read_frame
from meshnet.dataplane.receipts import sign_step
from meshnet.layers import LayerRange
from meshnet.protocol.signing import b64url
from meshnet.tracker.app import build_app
from meshnet.tracker.service import TrackerSettings
from tests.payloads import SignAsNodes, capability_report, node_key, registration, route_ticket, signed

MODEL = "tiny-llama"  # a preset with hidden_size 64: challenges run


def frame(array: np.ndarray) -> bytes:
    """A float32 activation frame (ADR-0001) of ``array``."""
    header = struct.pack("<4sBBBB", b"MSHN", 1, 2, array.ndim, 0) + struct.pack(f"<{array.ndim}I", *array.shape)
    return header + array.astype("<f4").tobytes()


class ComputingNodes(httpx.AsyncBaseTransport):
    """Fake nodes: health answers; ``/v1/forward`` returns ``tanh(input)`` (plus noise on hosts in
    ``dishonest``); releases answer 200. Records every forward call's host."""

    def __init__(self) -> None:
        self.dishonest: set[str] = set()
        self.failing: set[str] = set()  # hosts whose forward answers 500
        self.forwards: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/forward":
            self.forwards.append(host)
            if host in self.failing:
                return httpx.Response(500, json={"error": {"message": "boom", "code": "forward_failed"}})
            out = np.tanh(read_frame(await request.aread()))
            if host in self.dishonest:
                out = out + np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
            return httpx.Response(200, content=frame(out))
        return httpx.Response(200, json={"released": True})


def node(node_id: str, start: int, end: int, *, digest: str = "d1", entry: bool | None = None,
         compute_dtype: str = "float32") -> dict:
    report = capability_report(MODEL, start, end)
    report["weights_digest"] = digest
    report["recipe"]["compute_dtype"] = compute_dtype
    shard = {"model": MODEL, "shard_start": start, "shard_end": end, "entry": start == 0 if entry is None else entry,
             "tier": "pinned", "quantization": "bfloat16", "report": report}
    return registration(node_id, f"http://{node_id}.test:8000", vram_bytes=2 * 1024**3, shards=[shard])


async def tracker_client(asgi_client, nodes: httpx.AsyncBaseTransport | None = None, db: str = ":memory:",
                         **settings):
    """A client of an in-process tracker of :data:`MODEL` (operator token ``op``, no control loop)
    on ``db`` whose calls to nodes go to ``nodes`` (default: fresh :class:`ComputingNodes`);
    ``client.app`` and ``client.nodes`` are the app and the fake nodes."""
    nodes = nodes or ComputingNodes()
    app = build_app(TrackerSettings(models=(MODEL,), db_path=db, operator_token="op", **settings), run_loop=False,
                    transport=nodes)
    client = await asgi_client(app, "http://tracker", auth=SignAsNodes())
    client.app, client.nodes = app, nodes
    return client


@pytest.fixture
async def mesh(asgi_client):
    return await tracker_client(asgi_client)


async def verification(client, node_id: str, timeout_s: float = 5.0) -> dict:
    """The node's shard verification once it is no longer pending (bounded wait)."""
    for _ in range(int(timeout_s / 0.02)):
        view = next(n for n in (await client.get("/v1/nodes")).json()["nodes"] if n["node_id"] == node_id)
        state = view["shards"][0]["verification"]
        if state is not None and state["state"] != "pending":
            return {**state, "admitted": view["shards"][0]["admitted"]}
        await asyncio.sleep(0.02)
    raise AssertionError(f"{node_id} still pending after {timeout_s} s")


async def test_the_first_holder_is_unverified_and_a_second_is_challenged_against_it(mesh):
    assert (await mesh.post("/v1/nodes/register", json=node("a", 0, 3))).status_code == 200
    first = await verification(mesh, "a")
    assert first["state"] == "unverified" and first["admitted"] is True
    assert "no other admitted holder" in first["reason"]
    assert mesh.nodes.forwards == []  # nothing to compare with: no challenge
    await mesh.post("/v1/nodes/register", json=node("b", 0, 3))
    second = await verification(mesh, "b")
    assert second["state"] == "verified" and second["admitted"] is True
    assert second["references"] == ["a"] and second["distances"] == {"b|a": 0.0}
    assert sorted(mesh.nodes.forwards) == ["a.test", "b.test"]  # one challenge call each


async def test_a_holder_that_answers_the_challenge_wrongly_is_rejected_with_the_evidence(mesh):
    await mesh.post("/v1/nodes/register", json=node("a", 0, 3))
    await verification(mesh, "a")
    mesh.nodes.dishonest.add("bad.test")
    await mesh.post("/v1/nodes/register", json=node("bad", 0, 3))
    got = await verification(mesh, "bad")
    assert got["state"] == "rejected" and got["admitted"] is False
    assert got["references"] == ["a"] and got["distances"]["bad|a"] > 0.5 and got["tolerance"] == 0.05
    route = (await mesh.get("/v1/route", params={"model": MODEL, "exclude": "a"}))
    assert route.status_code == 503  # the rejected holder is never routed


async def test_the_known_digest_outlives_a_tracker_restart(asgi_client, tmp_path):
    """After a restart on the same database, the first node to register again is still held to
    the digest admitted before: another digest is rejected without a challenge."""
    db = str(tmp_path / "tracker.db")
    first = await tracker_client(asgi_client, db=db)
    await first.post("/v1/nodes/register", json=node("a", 0, 3, digest="d1"))
    assert (await verification(first, "a"))["state"] == "unverified"
    restarted = await tracker_client(asgi_client, db=db)
    await restarted.post("/v1/nodes/register", json=node("b", 0, 3, digest="other"))
    got = await verification(restarted, "b")
    assert got["state"] == "rejected" and "weights digest other differs from d1" in got["reason"]


async def test_a_weights_digest_other_than_the_known_one_is_rejected_without_a_challenge(mesh):
    await mesh.post("/v1/nodes/register", json=node("a", 0, 3, digest="d1"))
    await verification(mesh, "a")
    await mesh.post("/v1/nodes/register", json=node("b", 0, 3, digest="other"))
    got = await verification(mesh, "b")
    assert got["state"] == "rejected" and "weights digest other differs from d1" in got["reason"]
    assert mesh.nodes.forwards == []


async def test_a_reference_that_turned_dishonest_is_outvoted_by_a_third_holder_and_quarantined(mesh):
    await mesh.post("/v1/nodes/register", json=node("a", 0, 3))
    await verification(mesh, "a")
    await mesh.post("/v1/nodes/register", json=node("b", 0, 3))
    assert (await verification(mesh, "b"))["state"] == "verified"
    mesh.nodes.dishonest.add("a.test")  # a turns bad after its own admission
    await mesh.post("/v1/nodes/register", json=node("c", 0, 3))
    got = await verification(mesh, "c")
    assert got["state"] == "verified" and got["references"] == ["a", "b"]
    assert got["distances"]["c|a"] > 0.5 and got["distances"]["c|b"] == 0.0 and got["distances"]["a|b"] > 0.5
    view = next(n for n in (await mesh.get("/v1/nodes")).json()["nodes"] if n["node_id"] == "a")
    assert view["quarantine"]["reported_by"] == "tracker (admission challenge)"
    assert view["quarantine"]["witnesses"] == ["c", "b"]
    assert view["shards"][0]["admitted"] is False


async def entry_and_three_holders(mesh) -> None:
    await mesh.post("/v1/nodes/register", json=node("entry", 0, 1))
    for name in ("h1", "h2", "h3"):
        await mesh.post("/v1/nodes/register", json=node(name, 2, 3))
        await verification(mesh, name)


CHAIN = uuid.UUID(int=1).hex
NOISE = 1.0  # what a lying holder adds to one output (tanh outputs are within -1..1)


async def h1_ticket(mesh, entry: str = "entry", chain: str = CHAIN) -> str:
    """The ticket of chain ``chain`` whose route put h1 on ``entry``'s route."""
    return await route_ticket(mesh, entry, MODEL, 2, 3, chain, exclude=("h2", "h3"))


def audit_report(ticket: str, *, lied: bool = True, signer: str = "h1", chain: str = CHAIN) -> dict:
    """An audit's evidence against h1 (ADR-0067): a 4-token prefill at position 0 and one decode
    step, as h1 signed them; with ``lied`` h1's decode output is off by :data:`NOISE`."""
    key, steps = node_key(signer), []
    for position, tokens, seed in ((0, 4, 1), (4, 1, 2)):
        x = np.random.default_rng(seed).standard_normal((1, tokens, 64)).astype(np.float32)
        out = np.tanh(x) + (NOISE if lied and position > 0 else 0.0)
        a, b = frame(x), frame(out)
        steps.append({"position": position, "tokens": tokens, "flags": 0, "input": b64url(a), "output": b64url(b),
                      "receipt": b64url(sign_step(key, MODEL, chain, LayerRange(2, 4), position, tokens, 0, a, b).to_bytes())})
    return {"model": MODEL, "shard_start": 2, "shard_end": 3, "chain_id": chain, "ticket": ticket, "steps": steps}


async def post_signed(mesh, sender: str, path: str, body: dict) -> httpx.Response:
    raw = json.dumps(body).encode()
    return await mesh.post(path, content=raw, headers={**signed(sender, "POST", path, raw),
                                                       "Content-Type": "application/json"})


async def view_of(mesh, node_id: str) -> dict:
    return next(n for n in (await mesh.get("/v1/nodes")).json()["nodes"] if n["node_id"] == node_id)


async def test_an_audit_quarantines_the_node_its_witnesses_outvote_until_the_operator_reinstates_it(mesh):
    await entry_and_three_holders(mesh)
    mesh.nodes.forwards.clear()
    resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit", audit_report(await h1_ticket(mesh)))
    assert resp.status_code == 200, resp.text
    assert resp.json()["verdict"] == "quarantine"
    assert sorted(mesh.nodes.forwards) == ["h2.test"] * 2 + ["h3.test"] * 2  # the tracker re-ran both steps on each
    view = await view_of(mesh, "h1")
    assert view["quarantine"]["reported_by"] == "entry" and view["quarantine"]["witnesses"] == ["h2", "h3"]
    distances = view["quarantine"]["distances"]
    assert distances["h2|h3"] == 0.0 and distances["h1|h2"] > 0.5 and distances["h1|h3"] > 0.5
    assert [s["admitted"] for s in view["shards"]] == [False]
    for _ in range(5):
        hops = (await mesh.get("/v1/route", params={"model": MODEL, "start_layer": 2, "end_layer": 3,
                                                    "exclude": "h2"})).json()["hops"]
        assert [h["node_id"] for h in hops] == ["h3"]
    # a re-registration keeps the quarantine
    await mesh.post("/v1/nodes/register", json=node("h1", 2, 3))
    assert (await view_of(mesh, "h1"))["quarantine"] is not None
    assert (await mesh.post("/v1/operator/reinstate", json={"node_id": "h1"})).status_code == 401
    resp = await mesh.post("/v1/operator/reinstate", json={"node_id": "h1"}, headers={"Authorization": "Bearer op"})
    assert resp.json() == {"node_id": "h1", "reinstated": True}
    assert (await verification(mesh, "h1"))["admitted"] is True
    assert (await view_of(mesh, "entry"))["quarantine"] is None


async def test_a_quarantine_outlives_a_tracker_restart_and_a_reinstatement_too(asgi_client, tmp_path):
    """The quarantine is kept in the tracker's store: a tracker restarted on the same database
    keeps h1 out of routes after it registers again, with the same evidence; once reinstated,
    a second restart does not bring the quarantine back."""
    db = str(tmp_path / "tracker.db")

    async def tracker():
        nodes = ComputingNodes()
        app = build_app(TrackerSettings(models=(MODEL,), db_path=db, operator_token="op"), run_loop=False,
                        transport=nodes)
        client = await asgi_client(app, "http://tracker", auth=SignAsNodes())
        client.nodes = nodes
        return client

    first = await tracker()
    await entry_and_three_holders(first)
    resp = await post_signed(first, "entry", "/v1/nodes/h1/audit", audit_report(await h1_ticket(first)))
    assert resp.status_code == 200 and resp.json()["verdict"] == "quarantine", resp.text
    before = (await view_of(first, "h1"))["quarantine"]

    restarted = await tracker()
    await entry_and_three_holders(restarted)
    view = await view_of(restarted, "h1")
    assert view["quarantine"] == before and [s["admitted"] for s in view["shards"]] == [False]
    hops = (await restarted.get("/v1/route", params={"model": MODEL, "start_layer": 2, "end_layer": 3,
                                                     "exclude": "h2"})).json()["hops"]
    assert [h["node_id"] for h in hops] == ["h3"]
    resp = await restarted.post("/v1/operator/reinstate", json={"node_id": "h1"},
                                headers={"Authorization": "Bearer op"})
    assert resp.json() == {"node_id": "h1", "reinstated": True}

    again = await tracker()
    await entry_and_three_holders(again)
    view = await view_of(again, "h1")
    assert view["quarantine"] is None and view["shards"][0]["admitted"] is True


@pytest.mark.parametrize("sender, ticket, why", [
    ("h2", "h1", "the sender holds no entry shard"),
    ("entry", "h2", "its ticket's route does not name h1"),
    ("entry", "entry2's", "its ticket was issued to entry2, not to entry"),
    ("entry", "forged", "not one this tracker issued"),
    ("entry", "another chain's", f"not {CHAIN}"),
])
async def test_an_audit_report_from_an_entry_that_did_not_route_the_node_changes_nothing(mesh, sender, ticket, why):
    await entry_and_three_holders(mesh)
    await mesh.post("/v1/nodes/register", json=node("entry2", 0, 1))
    tickets = {"h1": await h1_ticket(mesh), "entry2's": await h1_ticket(mesh, "entry2", chain=uuid.UUID(int=3).hex),
               "h2": await route_ticket(mesh, "entry", MODEL, 2, 3, CHAIN, exclude=("h1", "h3")),
               "forged": (await h1_ticket(mesh)).rsplit(".", 1)[0] + "." + "A" * 86,
               "another chain's": await h1_ticket(mesh, chain=uuid.UUID(int=2).hex)}
    resp = await post_signed(mesh, sender, "/v1/nodes/h1/audit", audit_report(tickets[ticket]))
    assert resp.status_code == 403, resp.text
    assert resp.json()["error"]["code"] == "not_on_route" and why in resp.json()["error"]["message"]
    for name in ("h1", "entry", sender):
        assert (await view_of(mesh, name))["quarantine"] is None


async def test_evidence_the_accused_did_not_sign_quarantines_the_entry_that_forged_it(mesh):
    await entry_and_three_holders(mesh)
    resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit", audit_report(await h1_ticket(mesh), signer="h2"))
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "forged_evidence", resp.text
    assert (await view_of(mesh, "h1"))["quarantine"] is None
    marked = (await view_of(mesh, "entry"))["quarantine"]
    assert marked["reported_by"] == "tracker (forged accusation of h1)"


async def test_an_entry_that_accuses_honest_nodes_is_marked_and_quarantined_at_its_third_false_accusation(mesh):
    await entry_and_three_holders(mesh)
    for attempt in (1, 2, 3):
        resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit",
                                 audit_report(await h1_ticket(mesh), lied=False))
        assert resp.status_code == 200, resp.text
        assert resp.json()["verdict"] == "false_accusation"
        assert resp.json()["distances"] == {"h1|h2": 0.0, "h1|h3": 0.0, "h2|h3": 0.0}
        assert (await view_of(mesh, "h1"))["quarantine"] is None
        entry = await view_of(mesh, "entry")
        assert entry["accusations"] == {"upheld": 0, "false": attempt, "forged": 0}
        assert (entry["quarantine"] is None) if attempt < 3 else \
            entry["quarantine"]["reported_by"] == "tracker (false_accusation accusation of h1)"


async def test_an_entry_whose_accusations_are_mostly_upheld_is_not_quarantined_for_a_few_false_ones(mesh):
    """An honest entry whose own witness lied to it accuses an honest node now and then; its other
    disputes catch liars, and it stays in."""
    await entry_and_three_holders(mesh)
    mesh.nodes.dishonest.add("h3.test")  # h3 lies to the tracker's re-runs
    for _ in range(3):
        resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit", audit_report(await h1_ticket(mesh), lied=False))
        assert resp.json()["verdict"] == "witness_outvoted"  # h3 caught lying to the re-run: upheld
        mesh.nodes.dishonest.clear()
        await mesh.post("/v1/operator/reinstate", json={"node_id": "h3"}, headers={"Authorization": "Bearer op"})
        await verification(mesh, "h3")
        mesh.nodes.dishonest.add("h3.test")
    mesh.nodes.dishonest.clear()
    for _ in range(3):
        resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit", audit_report(await h1_ticket(mesh), lied=False))
        assert resp.json()["verdict"] == "false_accusation"
    entry = await view_of(mesh, "entry")
    assert entry["accusations"] == {"upheld": 3, "false": 3, "forged": 0} and entry["quarantine"] is None
    assert (await view_of(mesh, "h1"))["quarantine"] is None


async def test_a_witness_that_lies_to_the_trackers_re_run_is_the_one_quarantined(mesh):
    await entry_and_three_holders(mesh)
    mesh.nodes.dishonest.add("h3.test")  # h3 turns bad after its admission
    resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit", audit_report(await h1_ticket(mesh), lied=False))
    assert resp.status_code == 200 and resp.json()["verdict"] == "witness_outvoted", resp.text
    assert resp.json()["distances"]["h1|h2"] == 0.0 and resp.json()["distances"]["h2|h3"] > 0.5
    assert (await view_of(mesh, "h3"))["quarantine"]["reported_by"] == "tracker (outvoted as an audit witness)"
    assert (await view_of(mesh, "h1"))["quarantine"] is None and (await view_of(mesh, "entry"))["quarantine"] is None


def replay_body(*, lied: bool, signer: str = "h4") -> dict:
    """The entry's witness h4's signed replay of audit_report's inputs: one 5-token chunk, every
    position returned; with ``lied`` its outputs are off by :data:`NOISE`."""
    session = uuid.UUID(int=2).hex
    x = np.concatenate([np.random.default_rng(seed).standard_normal((1, tokens, 64)).astype(np.float32)
                        for tokens, seed in ((4, 1), (1, 2))], axis=1)
    a, b = frame(x), frame(np.tanh(x) + (NOISE if lied else 0.0))
    step = {"position": 0, "tokens": 5, "flags": 0, "input": b64url(a), "output": b64url(b),
            "receipt": b64url(sign_step(node_key(signer), MODEL, session, LayerRange(2, 4), 0, 5, 0, a, b).to_bytes())}
    return {"witness": "h4", "session": session, "steps": [step]}


async def test_the_entrys_own_witness_that_lied_to_its_audit_is_quarantined_by_its_signed_replay_not_the_entry(mesh):
    """ADR-0067 (amended 2026-12-07): an honest entry disputed an honest h1 because its witness h4
    lied to it. The tracker's witnesses (never h4) agree with h1; h4's signed replay shows the
    entry measured truly: h4 is quarantined and the dispute counts as upheld."""
    await entry_and_three_holders(mesh)
    await mesh.post("/v1/nodes/register", json=node("h4", 2, 3))
    await verification(mesh, "h4")
    ticket = await route_ticket(mesh, "entry", MODEL, 2, 3, CHAIN, exclude=("h2", "h3", "h4"))
    body = {**audit_report(ticket, lied=False), "replay": replay_body(lied=True)}
    resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit", body)
    assert resp.status_code == 200 and resp.json()["verdict"] == "replay_outvoted", resp.text
    assert resp.json()["outvoted"] == "h4"
    distances = resp.json()["distances"]
    assert distances["h1|h2"] == distances["h1|h3"] == 0.0 and min(distances["h1|h4"], distances["h2|h4"],
                                                                   distances["h3|h4"]) > 0.5
    assert (await view_of(mesh, "h4"))["quarantine"]["reported_by"] == \
        "tracker (its signed replay for an entry's audit outvoted)"
    entry = await view_of(mesh, "entry")
    assert entry["quarantine"] is None and entry["accusations"] == {"upheld": 1, "false": 0, "forged": 0}
    assert (await view_of(mesh, "h1"))["quarantine"] is None
    metrics = (await mesh.get("/metrics")).text
    assert 'meshnet_audit_verdicts_total{verdict="replay_outvoted"} 1.0' in metrics
    assert "meshnet_quarantined_nodes 1.0" in metrics
    assert 'meshnet_accusations{outcome="upheld"} 1.0' in metrics
    assert 'meshnet_accusations{outcome="false"} 0.0' in metrics


async def test_with_three_holders_the_entrys_witness_re_runs_for_the_tracker_too_and_its_replay_outvotes_it(mesh):
    """Only h1 (accused), h2 and h3 hold the range: the tracker asks h3, the entry's witness, last,
    and h3's honest re-run is unlike the replay it signed for the entry."""
    await entry_and_three_holders(mesh)
    replay = {**replay_body(lied=True, signer="h3"), "witness": "h3"}
    resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit",
                             {**audit_report(await h1_ticket(mesh), lied=False), "replay": replay})
    assert resp.status_code == 200 and resp.json()["verdict"] == "replay_outvoted", resp.text
    assert resp.json()["outvoted"] == "h3" and resp.json()["distances"]["h3|h3"] > 0.5
    assert (await view_of(mesh, "entry"))["accusations"] == {"upheld": 1, "false": 0, "forged": 0}


@pytest.mark.parametrize("replay, why", [
    ({"lied": False}, "replay agrees with"),                   # the witness told the truth: the entry made it up
    ({"lied": True, "signer": "h3"}, "replay does not stand"),  # not h4's signature: the entry's word again
])
async def test_a_replay_that_agrees_with_the_accused_or_is_not_its_witnesss_leaves_the_accusation_false(mesh, replay,
                                                                                                         why):
    await entry_and_three_holders(mesh)
    await mesh.post("/v1/nodes/register", json=node("h4", 2, 3))
    await verification(mesh, "h4")
    ticket = await route_ticket(mesh, "entry", MODEL, 2, 3, CHAIN, exclude=("h2", "h3", "h4"))
    body = {**audit_report(ticket, lied=False), "replay": replay_body(**replay)}
    resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit", body)
    assert resp.status_code == 200 and resp.json()["verdict"] == "false_accusation", resp.text
    assert why in resp.json()["reason"]
    assert (await view_of(mesh, "h4"))["quarantine"] is None
    assert (await view_of(mesh, "entry"))["accusations"] == {"upheld": 0, "false": 1, "forged": 0}


async def test_distances_alone_no_longer_quarantine_anyone(mesh):
    """An entry's word is no evidence (ADR-0067): a spot-check report of distances is refused and
    changes nothing, however strongly it outvotes the node."""
    await entry_and_three_holders(mesh)
    body = {"model": MODEL, "shard_start": 2, "shard_end": 3, "witnesses": ["h2", "h3"],
            "distances": {"h1|h2": 0.9, "h1|h3": 0.8, "h2|h3": 0.0}, "tolerance": 0.05, "session": "s1",
            "ticket": await h1_ticket(mesh)}
    resp = await post_signed(mesh, "entry", "/v1/nodes/h1/quarantine", body)
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "weak_evidence", resp.text
    assert "/audit" in resp.json()["error"]["hint"]
    assert (await view_of(mesh, "h1"))["quarantine"] is None
    resp = await post_signed(mesh, "h2", "/v1/nodes/h1/quarantine", body)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "not_on_route"


async def test_hops_whose_range_has_no_second_holder_are_unverified_in_the_route(mesh):
    await mesh.post("/v1/nodes/register", json=node("entry", 0, 1))
    await mesh.post("/v1/nodes/register", json=node("h1", 2, 3))
    await verification(mesh, "h1")
    route = (await mesh.get("/v1/route", params={"model": MODEL})).json()
    assert route["unverified"] == ["entry", "h1"]
    await mesh.post("/v1/nodes/register", json=node("h2", 2, 3))
    await verification(mesh, "h2")
    route = (await mesh.get("/v1/route", params={"model": MODEL})).json()
    assert route["unverified"] == ["entry"]


async def test_holders_of_another_recipe_neither_challenge_nor_witness_each_other(mesh):
    """A bfloat16-compute holder differs honestly from a float32 one by more than the bfloat16
    tolerance (bench/spotcheck.py): it is admitted unverified, not challenged against it, and a
    witness route (``like=``) keeps to the checked node's recipe."""
    await mesh.post("/v1/nodes/register", json=node("entry", 0, 1))
    await mesh.post("/v1/nodes/register", json=node("h1", 2, 3))
    await verification(mesh, "h1")
    await mesh.post("/v1/nodes/register", json=node("h2", 2, 3, digest="d2", compute_dtype="bfloat16"))
    got = await verification(mesh, "h2")
    assert got["state"] == "unverified" and "of this recipe" in got["reason"]
    await mesh.post("/v1/nodes/register", json=node("h3", 2, 3))
    assert (await verification(mesh, "h3"))["references"] == ["h1"]
    like = {"model": MODEL, "start_layer": 2, "end_layer": 3}
    for _ in range(3):
        hops = (await mesh.get("/v1/route", params={**like, "exclude": "h1", "like": "h1"})).json()["hops"]
        assert [h["node_id"] for h in hops] == ["h3"]
    assert (await mesh.get("/v1/route", params={**like, "exclude": "h2", "like": "h2"})).status_code == 503
    resp = await post_signed(mesh, "entry", "/v1/nodes/h1/audit", audit_report(await h1_ticket(mesh)))
    assert resp.status_code == 200, resp.text  # only h3 shares h1's recipe: one witness is no verdict
    assert resp.json()["verdict"] == "inconclusive" and "1 witness(es)" in resp.json()["reason"]
    assert (await view_of(mesh, "h1"))["quarantine"] is None


async def test_a_challenge_call_that_fails_is_no_verdict_and_the_next_heartbeat_tries_again(mesh):
    await mesh.post("/v1/nodes/register", json=node("a", 0, 3))
    await verification(mesh, "a")
    mesh.nodes.failing.add("b.test")
    payload = node("b", 0, 3)
    await mesh.post("/v1/nodes/register", json=payload)
    got = await verification(mesh, "b")
    assert got["state"] == "failed" and got["admitted"] is False and "500" in got["reason"]
    mesh.nodes.failing.clear()
    resp = await mesh.post("/v1/nodes/b/heartbeat", json={"shards": payload["shards"]})
    assert resp.status_code == 200, resp.text
    got = await verification(mesh, "b")
    assert got["state"] == "verified" and got["admitted"] is True
