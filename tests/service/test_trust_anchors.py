"""Operator trust anchors (ADR-0069), tracker in-process: a node the operator trusts is verified on
the operator's word, its weights digest sets the bar for its range and recipe (a forged digest
heard first no longer does), it is the first reference of other holders' challenges, and the mark
outlives a restart. The fake nodes are :mod:`tests.service.test_admission_and_quarantine`'s."""

from __future__ import annotations

import uuid

from tests.payloads import signed
from tests.service.test_admission_and_quarantine import (MODEL, mesh, node,  # noqa: F401 - mesh: a fixture
                                                          tracker_client, verification)

OPERATOR = {"Authorization": "Bearer op"}


async def trust(client, node_id: str, trusted: bool = True):
    return await client.post("/v1/operator/trust", json={"node_id": node_id, "trusted": trusted}, headers=OPERATOR)


async def test_a_trusted_first_holder_is_verified_and_the_reference_of_the_next(mesh):
    await mesh.post("/v1/nodes/register", json=node("z-anchor", 0, 3))
    assert (await verification(mesh, "z-anchor"))["state"] == "unverified"  # the first holder, on its own word
    resp = await trust(mesh, "z-anchor")
    assert resp.status_code == 200 and resp.json() == {"node_id": "z-anchor", "trusted": True, "changed": True}
    got = await verification(mesh, "z-anchor")
    assert got["state"] == "verified" and got["reason"] == "trusted by the operator (meshnet trust)"
    assert (await trust(mesh, "z-anchor")).json()["changed"] is False
    await mesh.post("/v1/nodes/register", json=node("b", 0, 3))
    assert (await verification(mesh, "b"))["references"] == ["z-anchor"]
    await mesh.post("/v1/nodes/register", json=node("c", 0, 3))
    assert (await verification(mesh, "c"))["references"] == ["z-anchor"]  # trusted first, though "b" sorts first
    view = {n["node_id"]: n for n in (await mesh.get("/v1/nodes")).json()["nodes"]}
    assert view["z-anchor"]["trusted"] is True and view["b"]["trusted"] is False


async def test_a_trusted_digest_replaces_a_forged_one_heard_first(mesh):
    """The issue's finding: the first digest the tracker heard for a range won, and an honest node
    joining later was refused. Trusting the honest node makes its digest the known one, and the
    node that forged the first is decided again: rejected."""
    await mesh.post("/v1/nodes/register", json=node("forger", 0, 3, digest="forged"))
    assert (await verification(mesh, "forger"))["state"] == "unverified"
    await mesh.post("/v1/nodes/register", json=node("honest", 0, 3, digest="real"))
    assert (await verification(mesh, "honest"))["state"] == "rejected"
    await trust(mesh, "honest")
    assert (await verification(mesh, "honest"))["state"] == "verified"
    got = await verification(mesh, "forger")
    assert got["state"] == "rejected" and "weights digest forged differs from real" in got["reason"]
    await mesh.post("/v1/nodes/register", json=node("late", 0, 3, digest="real"))
    assert (await verification(mesh, "late"))["references"] == ["honest"]


async def test_trust_needs_the_operator_a_known_node_and_outlives_a_restart(asgi_client, tmp_path):
    db = str(tmp_path / "tracker.db")
    first = await tracker_client(asgi_client, db=db)
    await first.post("/v1/nodes/register", json=node("a", 0, 3))
    await verification(first, "a")
    assert (await first.post("/v1/operator/trust", json={"node_id": "a"})).status_code == 401
    assert (await trust(first, "nobody")).status_code == 404
    bad = await first.post("/v1/operator/trust", json={"node_id": "a", "trusted": "very"}, headers=OPERATOR)
    assert bad.status_code == 422 and "trusted" in bad.text
    await trust(first, "a")
    restarted = await tracker_client(asgi_client, db=db)
    await restarted.post("/v1/nodes/register", json=node("a", 0, 3))
    assert (await verification(restarted, "a"))["state"] == "verified"
    assert (await trust(restarted, "a", trusted=False)).json()["changed"] is True
    assert (await verification(restarted, "a"))["state"] == "unverified"  # on its own word again


async def test_routes_say_whether_they_are_verified_and_an_operator_can_require_it(asgi_client):
    """A range held only by its first, unchecked holder routes with ``verified: false``; with
    ``require_verified`` it does not route (503, the model not routable) until the operator trusts
    that holder, or a second holder is checked against it."""
    client = await tracker_client(asgi_client, require_verified=True)
    await client.post("/v1/nodes/register", json=node("a", 0, 3))
    assert (await verification(client, "a"))["state"] == "unverified"
    refused = await client.get("/v1/route", params={"model": MODEL})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_loading"
    assert (await client.get(f"/v1/coverage/{MODEL}")).json()["routable"] is False
    await trust(client, "a")
    route = await client.get("/v1/route", params={"model": MODEL})
    assert route.status_code == 200 and route.json()["verified"] is True
    assert [h["node_id"] for h in route.json()["hops"]] == ["a"]


async def test_without_the_switch_an_unchecked_route_serves_and_says_so(mesh):
    await mesh.post("/v1/nodes/register", json=node("a", 0, 3))
    await verification(mesh, "a")
    assert (await mesh.get("/v1/route", params={"model": MODEL})).json()["verified"] is False
    await mesh.post("/v1/nodes/register", json=node("b", 0, 3))
    assert (await verification(mesh, "b"))["state"] == "verified"
    route = (await mesh.get("/v1/route", params={"model": MODEL, "exclude": "a"})).json()
    assert route["hops"][0]["node_id"] == "b" and route["verified"] is True


async def test_a_sessions_route_answers_for_its_entrys_own_layers_too(mesh):
    """An entry asks for a session's remote layers (2-3); the route is verified only when the
    entry's own shard (0-1) is too: the chat's answer says so (``meshnet.verified``)."""
    for name, (start, end) in (("entry", (0, 1)), ("h1", (2, 3)), ("h2", (2, 3))):
        await mesh.post("/v1/nodes/register", json=node(name, start, end))
        await verification(mesh, name)

    async def verified(session: str) -> bool:
        path = f"/v1/route?model={MODEL}&start_layer=2&end_layer=3&session={session}&exclude=h1"
        resp = await mesh.get(path, headers=signed("entry", "GET", path))
        assert resp.status_code == 200, resp.text
        assert [h["node_id"] for h in resp.json()["hops"]] == ["h2"]  # h2: checked against h1
        return resp.json()["verified"]

    assert await verified(uuid.UUID(int=5).hex) is False  # the entry: its range's only holder
    await trust(mesh, "entry")
    assert await verified(uuid.UUID(int=6).hex) is True
