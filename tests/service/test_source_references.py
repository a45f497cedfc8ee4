"""Admission references from the model's own files (ADR-0070), tracker in-process.

The tracker reads the tiny seeded preset's files (a throwaway cache) and computes each
challenge's reference layer by layer (:class:`meshnet.node.reference.SourceReferences`); the
nodes answer hop calls with the same preset's real layers (:class:`LayerNodes`), a dishonest host
with noise added. So the first holder of a range is verified, a range no holder covers is
verified, and a forger that joins first sets no bar for the honest holder after it.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from meshnet.dataplane.frames import read_array, read_frame
from meshnet.layers import LayerRange
from meshnet.node.reference import SourceReferences
from meshnet.protocol.tickets import HEADER_TICKET
from meshnet.tracker.app import build_app
from meshnet.tracker.service import TrackerService, TrackerSettings
from tests.payloads import SignAsNodes
from tests.service.test_admission_and_quarantine import MODEL, frame, node, verification


class LayerNodes(httpx.AsyncBaseTransport):
    """Nodes that run :data:`MODEL`'s real layers (float32) on each ``/v1/forward``; hosts in
    ``dishonest`` add noise of ``noise`` x the output's std. Records every forward call's host."""

    def __init__(self, tiny_shard) -> None:
        self.tiny_shard = tiny_shard
        self.dishonest: set[str] = set()
        self.noise = 0.5
        self.forwards: list[str] = []
        self.calls: list[tuple[str, np.ndarray, str]] = []  # (wire dtype, values, ticket) of each forward

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import torch

        from meshnet.models.caches import KVCache

        if request.url.path != "/v1/forward":
            return httpx.Response(200, json={"status": "ok", "released": True})
        self.forwards.append(request.url.host)
        start, end = int(request.headers["X-Meshnet-Start-Layer"]), int(request.headers["X-Meshnet-End-Layer"])
        shard = self.tiny_shard(MODEL, start, end + 1, load_head=False)
        body = await request.aread()
        self.calls.append((read_frame(body).dtype, read_array(body), request.headers[HEADER_TICKET]))
        out = shard.forward(torch.from_numpy(read_array(body).copy()), KVCache(), 0).numpy()
        if request.url.host in self.dishonest:
            out = out + self.noise * out.std() * np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
        return httpx.Response(200, content=frame(out))


@pytest.fixture
async def mesh(asgi_client, tiny_shard, tiny_model_path, monkeypatch):
    """An in-process tracker of :data:`MODEL` whose references come from its files."""
    monkeypatch.setenv("MESHNET_CACHE", str(tiny_model_path(MODEL).parent.parent))
    nodes = LayerNodes(tiny_shard)
    settings = TrackerSettings(models=(MODEL,), operator_token="op")
    reference = SourceReferences(settings.models)
    app = build_app(settings, TrackerService(settings, reference=reference), run_loop=False, transport=nodes)
    client = await asgi_client(app, "http://tracker", auth=SignAsNodes())
    client.app, client.nodes, client.reference = app, nodes, reference
    return client


async def test_the_first_holder_of_a_range_is_verified_against_the_models_files(mesh):
    assert (await mesh.post("/v1/nodes/register", json=node("a", 0, 3))).status_code == 200
    first = await verification(mesh, "a", timeout_s=60)
    assert first["state"] == "verified" and first["admitted"] is True
    assert first["references"] == ["@source"] and first["distances"] == {"a|@source": 0.0}
    assert "the model's own files" in first["reason"]
    assert mesh.nodes.forwards == ["a.test"] and mesh.reference.computed == 1
    route = (await mesh.get("/v1/route", params={"model": MODEL})).json()
    assert route["verified"] is True


async def test_a_first_holder_that_lies_on_its_challenge_is_rejected_with_nothing_to_outvote_the_files(mesh):
    mesh.nodes.dishonest.add("bad.test")
    await mesh.post("/v1/nodes/register", json=node("bad", 0, 3))
    got = await verification(mesh, "bad", timeout_s=60)
    assert got["state"] == "rejected" and got["admitted"] is False
    assert got["references"] == ["@source"] and got["distances"]["bad|@source"] > 0.3 and got["tolerance"] == 0.05
    assert (await mesh.get("/v1/route", params={"model": MODEL})).status_code == 503


async def test_a_forger_that_joins_first_sets_no_bar_for_the_honest_holder_after_it(mesh):
    mesh.nodes.dishonest.add("forger.test")
    await mesh.post("/v1/nodes/register", json=node("forger", 0, 3, digest="forged"))
    assert (await verification(mesh, "forger", timeout_s=60))["state"] == "rejected"
    await mesh.post("/v1/nodes/register", json=node("honest", 0, 3, digest="real"))
    got = await verification(mesh, "honest", timeout_s=60)
    assert got["state"] == "verified" and got["references"] == ["@source"]
    await mesh.post("/v1/nodes/register", json=node("copy", 0, 3, digest="forged"))
    late = await verification(mesh, "copy", timeout_s=60)  # the digest the honest holder's check taught the tracker
    assert late["state"] == "rejected" and "differs from real" in late["reason"]


async def test_a_range_that_straddles_two_holders_is_challenged_against_the_files(mesh):
    await mesh.post("/v1/nodes/register", json=node("a", 0, 1))
    await mesh.post("/v1/nodes/register", json=node("b", 2, 3, entry=False))
    mesh.nodes.dishonest.add("straddle.test")
    await mesh.post("/v1/nodes/register", json=node("straddle", 1, 2, entry=False))
    for honest in ("a", "b"):
        assert (await verification(mesh, honest, timeout_s=60))["state"] == "verified"
    got = await verification(mesh, "straddle", timeout_s=60)
    assert got["state"] == "rejected" and got["references"] == ["@source"]


async def test_a_small_lie_within_the_recipes_tolerance_is_not_caught_and_one_beyond_it_is(mesh):
    mesh.nodes.noise = 0.01  # inside the 0.05 of unquantized weights (a bfloat16 recipe's, ADR-0042)
    mesh.nodes.dishonest.add("close.test")
    await mesh.post("/v1/nodes/register", json=node("close", 0, 3))
    assert (await verification(mesh, "close", timeout_s=60))["state"] == "verified"
    mesh.nodes.noise = 0.2
    mesh.nodes.dishonest.add("off.test")
    await mesh.post("/v1/nodes/register", json=node("off", 0, 3))
    assert (await verification(mesh, "off", timeout_s=60))["state"] == "rejected"


async def test_a_model_whose_files_this_host_lacks_falls_back_to_holders(asgi_client, tiny_shard, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path))  # an empty cache: no files of the model here
    settings = TrackerSettings(models=(MODEL,), operator_token="op")
    reference = SourceReferences(settings.models)
    assert reference.holds(MODEL) is False and reference.holds("/etc") is False
    app = build_app(settings, TrackerService(settings, reference=reference), run_loop=False,
                    transport=LayerNodes(tiny_shard))
    client = await asgi_client(app, "http://tracker", auth=SignAsNodes())
    await client.post("/v1/nodes/register", json=node("a", 0, 3))
    first = await verification(client, "a")
    assert first["state"] == "unverified" and "no other admitted holder" in first["reason"]


async def test_a_challenge_looks_like_an_entrys_prefill_not_like_the_tracker(mesh):
    """Its input is a prompt's hidden states in the wire's bfloat16, not standard-normal float32
    values; its ticket names an entry as a node's default id, with a key that is not the tracker's."""
    import json
    import re

    from meshnet.protocol.signing import encode_public_key, unb64url

    await mesh.post("/v1/nodes/register", json=node("a", 0, 1))
    await mesh.post("/v1/nodes/register", json=node("b", 2, 3, entry=False))
    for node_id in ("a", "b"):
        assert (await verification(mesh, node_id, timeout_s=60))["state"] == "verified"
    tracker_key = encode_public_key(mesh.app.state.service.tickets.key.public_key())
    for dtype, values, ticket in mesh.nodes.calls:
        assert dtype == "bfloat16" and values.shape == (1, 16, 64)
        assert not 0.8 < float(values.std()) < 1.2  # embeddings (std ~0.02) and a layer's output, not N(0, 1)
        claims = json.loads(unb64url(ticket.split(".")[0]))
        assert re.fullmatch(r"node-[0-9a-f]{8}", claims["entry"]) and claims["entry_key"] != tracker_key
    assert len({json.loads(unb64url(t.split(".")[0]))["entry"] for _, _, t in mesh.nodes.calls}) == 2


def test_a_reference_run_layer_by_layer_equals_the_whole_range_loaded_at_once_in_each_recipe(
        tiny_shard, tiny_model_path, monkeypatch):
    import torch

    from meshnet.dataplane.evidence import challenge_frame, frame_distance
    from meshnet.models.caches import KVCache
    from meshnet.models.shard import ShardModel
    from meshnet.node import wire

    monkeypatch.setenv("MESHNET_CACHE", str(tiny_model_path(MODEL).parent.parent))
    reference = SourceReferences((MODEL,))
    challenge = challenge_frame(3, 16, 64)
    unquantized = wire.encode(tiny_shard(MODEL, 1, 4, load_head=False).forward(wire.decode(challenge), KVCache(), 0),
                              dtype=torch.float32)
    for quantization in ("bfloat16", "int8"):
        out = reference.compute(MODEL, LayerRange(1, 4), quantization, "float32", challenge)
        assert read_array(out).shape == (1, 16, 64)
        whole = ShardModel(tiny_model_path(MODEL), LayerRange(1, 4), dtype="float32", load_head=False,
                           quantization=quantization)
        assert frame_distance(out, wire.encode(whole.forward(wire.decode(challenge), KVCache(), 0),
                                               dtype=torch.float32)) == 0.0  # the same recipe, this host
        if quantization == "int8":  # and the recipe is really applied: near the unquantized output, not on it
            assert 0.0 < frame_distance(out, unquantized) < 0.15
    with pytest.raises(ValueError, match="auto or fetch"):
        SourceReferences((MODEL,), "off")
