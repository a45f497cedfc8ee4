"""Advertised endpoints with real processes (tiny seeded model): a node on IPv6 loopback is
reached and routed; a node whose --public-url nobody can connect to is never routed."""

from __future__ import annotations

import socket
import time

import pytest

from tests.integration.mesh import Mesh, free_port

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
ASK = [{"role": "user", "content": "hello"}]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def nodes(mesh: Mesh) -> dict:
    return {n["node_id"]: n for n in mesh.get("/v1/nodes")["nodes"]}


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_node_on_ipv6_loopback_without_a_port_registers_bracketed_and_serves(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache"))
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker(MODEL)
        mesh.start_node("v6", "--host", "::1", "--model", MODEL, "--shard-start", "0", "--shard-end", "3")
        mesh.wait_routable(MODEL, 60)
        node = nodes(mesh)["v6"]
        assert node["endpoint"].startswith("http://[::1]:") and node["reachable"] is True
        resp = mesh.chat(MODEL, ASK, max_tokens=4)
        assert resp.status_code == 200, resp.text
        assert resp.json()["meshnet"]["route"][0]["endpoint"] == node["endpoint"]
    finally:
        mesh.stop()


def test_a_node_nobody_can_reach_is_never_routed_and_a_chat_does_not_hang(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache"))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker(MODEL)
        # --no-auto-relay: otherwise it would serve through the tracker's relay (ADR-0045)
        mesh.start_node("hidden", "--model", MODEL, "--shard-start", "0", "--shard-end", "3", "--public-url", dead,
                        "--no-auto-relay")
        # registered with its shard, and the tracker's probe of its endpoint answered (it runs right
        # after the registration is recorded, so a poll in between sees "not probed yet")
        hidden = mesh.wait(lambda: (n := nodes(mesh).get("hidden")) and n["shards"]
                           and n["reach_error"] != "not probed yet" and n, 60, "hidden registered and probed")
        assert hidden["reachable"] is False and "ConnectError" in hidden["reach_error"]
        assert hidden["shards"][0]["capability"]["passed"] is True and hidden["shards"][0]["admitted"] is False
        t0 = time.monotonic()
        refused = mesh.chat(MODEL, ASK, max_tokens=4)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_loading"
        assert time.monotonic() - t0 < 5  # not the 65 s hang of a routed, unreachable node

        mesh.start_node("seen", "--model", MODEL, "--shard-start", "0", "--shard-end", "3")
        mesh.wait_routable(MODEL, 60)
        for _ in range(3):
            t0 = time.monotonic()
            resp = mesh.chat(MODEL, ASK, max_tokens=4)
            assert resp.status_code == 200, resp.text
            assert [h["node_id"] for h in resp.json()["meshnet"]["route"]] == ["seen"]
            assert time.monotonic() - t0 < 30
        assert nodes(mesh)["hidden"]["reachable"] is False
        assert f"the tracker cannot reach this node at {dead}" in mesh.tail("hidden", 40)
    finally:
        mesh.stop()
