"""Admission by doctor, stale reports, and demand placement, with real processes (tiny
seeded models keep these fast; the real model proves the same path elsewhere)."""

from __future__ import annotations


import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from meshnet.models.sources import resolve
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "hello"}]


def chat(mesh, model):
    return mesh.chat(model, ASK, max_tokens=4)


def test_failed_doctor_is_never_routed_until_fixed_and_reloaded(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MESHNET_CACHE", str(cache))
    weights = resolve("tiny-llama") / "model.safetensors"
    good = load_file(weights)
    broken = dict(good)
    key = "model.layers.1.mlp.down_proj.weight"
    broken[key] = torch.full_like(good[key], float("nan"))
    save_file(broken, weights, metadata={"format": "pt"})
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker("tiny-llama")
        mesh.start_node("sick", "--model", "tiny-llama", "--shard-start", "0", "--shard-end", "3",
                        env={"MESHNET_CACHE": str(cache)})
        node = mesh.wait(lambda: next((n for n in mesh.get("/v1/nodes")["nodes"] if n["shards"]), None), 60,
                         "node registered with its report")
        shard = node["shards"][0]
        assert shard["admitted"] is False and shard["capability"]["passed"] is False
        assert shard["capability"]["reason"] == "probe output has NaN or infinite values"
        assert mesh.get("/v1/coverage/tiny-llama")["covered_layers"] == 0
        resp = chat(mesh, "tiny-llama")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_loading"
        with pytest.raises(httpx.HTTPStatusError):
            mesh.get("/v1/route", params={"model": "tiny-llama"})

        save_file(good, weights, metadata={"format": "pt"})  # the fix
        reload = httpx.post(f"{mesh.url}/v1/operator/reload", json={"node_id": "sick"}, timeout=10)
        assert reload.status_code == 200
        mesh.wait_routable("tiny-llama", 60)
        assert chat(mesh, "tiny-llama").status_code == 200
        done = [d for d in mesh.get("/v1/directives")["directives"] if d["type"] == "RELOAD"]
        assert [d["status"] for d in done] == ["done"]

        # a reload makes the fresh report stale at once: out of routes until doctor passes again
        httpx.post(f"{mesh.url}/v1/operator/reload", json={"node_id": "sick"}, timeout=10)
        cov = mesh.get("/v1/coverage/tiny-llama")
        assert cov["routable"] is False and cov["covered_layers"] == 0
        mesh.wait_routable("tiny-llama", 60)
    finally:
        mesh.stop()


def test_demand_places_a_model_on_model_less_nodes_as_managed(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache"))
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker()  # keeps nothing covered until demand appears
        mesh.start_node("pinned", "--model", "tiny-gpt2", "--shard-start", "0", "--shard-end", "3")
        mesh.start_node("free-a", "--memory", "1")
        mesh.start_node("free-b", "--memory", "1")
        mesh.wait_routable("tiny-gpt2", 60)
        mesh.wait(lambda: len(mesh.get("/v1/nodes")["nodes"]) == 3, 60, "three nodes")

        refused = chat(mesh, "tiny-llama")
        assert refused.status_code == 503
        body = refused.json()
        assert body["error"]["code"] == "model_loading" and refused.headers["Retry-After"] == "5"
        assert body["coverage"]["covered_layers"] == 0 and body["coverage"]["num_layers"] == 4
        demand = {d["model"]: d for d in mesh.get("/v1/demand")["demand"]}
        assert demand["tiny-llama"]["requests_per_min"] == pytest.approx(60.0 / 300.0)  # 1 request / 5 min window
        assert demand["tiny-gpt2"]["requests_per_min"] == 0.0

        mesh.wait_routable("tiny-llama", 60)
        ok = chat(mesh, "tiny-llama")
        assert ok.status_code == 200
        loads = [d for d in mesh.get("/v1/directives")["directives"] if d["type"] == "LOAD_SHARD"]
        assert loads and all(d["tier"] == "managed" and d["model"] == "tiny-llama" for d in loads)
        assert {d["node_id"] for d in loads} <= {"free-a", "free-b"}
        nodes = {n["node_id"]: n for n in mesh.get("/v1/nodes")["nodes"]}
        assert [(s["model"], s["shard_start"], s["shard_end"], s["tier"]) for s in nodes["pinned"]["shards"]] == [
            ("tiny-gpt2", 0, 3, "pinned")]
        assert chat(mesh, "tiny-gpt2").status_code == 200
    finally:
        mesh.stop()
