"""Tracker placement with real node processes and the real model (issue: coverage-first
bin-packing, rebalance directives, dropout relocation)."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
MIB = 1024 * 1024


def shards_by_node(mesh) -> dict[str, list[tuple[int, int, str]]]:
    return {n["node_id"]: [(s["shard_start"], s["shard_end"], s["tier"]) for s in n["shards"]]
            for n in mesh.get("/v1/nodes")["nodes"]}


def test_model_less_nodes_get_covered_by_memory(real_model_path, tmp_path):
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker(REAL, extra=["--join-settle", "12"])  # plan the three joins together
        # 150 MiB -> floor(0.8 * 150 MiB / 7,080,192 B) = 17 layers; 100 MiB -> 11; 40 MiB -> 4
        mesh.start_node("big", "--memory", "150", "--max-shards", "2")
        mesh.start_node("mid", "--memory", "100")
        mesh.start_node("small", "--memory", "40")
        mesh.wait_routable(REAL, 180)
        nodes = {n["node_id"]: n for n in mesh.get("/v1/nodes")["nodes"]}
        assert nodes["big"]["vram_bytes"] == 150 * MIB and nodes["big"]["slots_total"] == 2
        assert nodes["mid"]["vram_bytes"] == 100 * MIB and nodes["mid"]["slots_total"] == 1
        assert nodes["big"]["max_assignable_layers"][REAL] == 17
        widths = {nid: sum(s["shard_end"] - s["shard_start"] + 1 for s in n["shards"]) for nid, n in nodes.items()}
        assert widths["big"] == max(widths.values()) == 17
        assert all(s["tier"] == "bootstrap" for n in nodes.values() for s in n["shards"])
        cov = mesh.get(f"/v1/coverage/{REAL}")
        assert cov["covered_layers"] == 30 and cov["routable"]
        loads = [d for d in mesh.get("/v1/directives")["directives"] if d["type"] == "LOAD_SHARD"]
        assert loads and all(d["status"] == "done" for d in loads)
        reply = mesh.chat(REAL, max_tokens=16).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
    finally:
        mesh.stop()


def test_dropout_is_refilled_by_an_idle_node(real_model_path, tmp_path):
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker(REAL, node_timeout_s=3.0)
        for name, (a, b) in {"n0": (0, 9), "n1": (10, 19), "n2": (20, 29)}.items():
            mesh.start_node(name, "--model", REAL, "--shard-start", str(a), "--shard-end", str(b))
        mesh.wait_routable(REAL, 180)
        mesh.start_node("spare", "--memory", "200")
        # no load yet, so no redundancy: the spare registers and stays idle (a hot spare)
        mesh.wait(lambda: "spare" in shards_by_node(mesh), 120, "spare registered")
        assert shards_by_node(mesh)["spare"] == []
        mesh.kill("n1")
        t_kill = time.monotonic()
        cov = mesh.wait(lambda: (c := mesh.get(f"/v1/coverage/{REAL}"))["covered_layers"] < 30 and c, 30,
                        "dropout noticed")
        assert {"start_layer": 10, "end_layer": 19, "node_count": 0} in cov["segments"]
        mesh.wait_routable(REAL, 30)
        assert time.monotonic() - t_kill < 30
        loads = [(d["node_id"], d["shard_start"], d["shard_end"], d["tier"], d["status"])
                 for d in mesh.get("/v1/directives")["directives"] if d["type"] == "LOAD_SHARD"]
        assert loads == [("spare", 10, 19, "bootstrap", "done")]
        held = shards_by_node(mesh)
        assert "n1" not in held and held["spare"] == [(10, 19, "bootstrap")]
        reply = mesh.chat(REAL, max_tokens=16).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        assert all(h["node_id"] != "n1" for h in reply["meshnet"]["route"])
    finally:
        mesh.stop()


def test_node_with_a_model_but_no_shard_asks_the_tracker_for_a_range(tmp_path, monkeypatch):
    """ADR-0011: `--model` alone → GET /v1/network/assign → the first gap, sized by memory."""
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache"))
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker("tiny-llama")
        mesh.start_node("joiner", "--model", "tiny-llama", "--memory", "1")
        mesh.wait_routable("tiny-llama", 60)
        assert shards_by_node(mesh) == {"joiner": [(0, 3, "bootstrap")]}
        assign = mesh.get("/v1/network/assign", params={"hf_repo": "tiny-llama", "vram_mb": 1})
        assert assign == {"hf_repo": "meshnet/tiny-llama", "model": "tiny-llama", "shard_start": 0, "shard_end": 3,
                          "num_layers": 4, "gap_found": False, "price_per_token": 0.0}
    finally:
        mesh.stop()
