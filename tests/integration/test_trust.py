"""Who may join, with real processes (ADR-0035): a tracker beyond loopback refuses to start
without tokens; an impostor that takes a running node's id is refused and the mesh keeps serving;
a stranger's hop calls carry no ticket and are refused (ADR-0038).
Every process is stopped by its PID."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import time

import httpx
import pytest

from meshnet.endpoints import free_port
from meshnet.localmesh import LocalMesh
from meshnet.models.sources import resolve

ASK = [{"role": "user", "content": "hello"}]


def tracker_process(tmp_path, *flags: str) -> tuple[subprocess.Popen, int]:
    port = free_port("0.0.0.0")
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "tracker", "start", "--host", "0.0.0.0",
                             "--port", str(port), "--db", str(tmp_path / "tracker.db"), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "HOME": str(tmp_path)})
    return proc, port


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def test_a_tracker_beyond_loopback_needs_tokens_or_insecure(tmp_path):
    proc, _ = tracker_process(tmp_path)
    try:
        code = proc.wait(timeout=60)
    finally:
        _, err = stop(proc)
    assert code != 0
    assert "beyond loopback" in err and "--join-token" in err and "--operator-token" in err and "--insecure" in err

    proc, port = tracker_process(tmp_path, "--insecure")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, stop(proc)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the --insecure tracker did not answer")
    finally:
        _, err = stop(proc)
    assert "INSECURE" in err


@pytest.mark.slow
def test_an_impostor_with_a_running_nodes_id_is_refused_and_the_mesh_keeps_serving(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache"))
    resolve("tiny-llama")  # built once here: two nodes building it at once would race
    operator = secrets.token_urlsafe(16)
    mesh = LocalMesh(tmp_path / "logs", join_token=secrets.token_urlsafe(16), operator_token=operator,
                     state_dir=tmp_path / "state")  # as `meshnet serve` runs it: both tokens set
    try:
        mesh.start_tracker("tiny-llama")
        mesh.start_node("node-0", "--model", "tiny-llama", "--shard-start", "0", "--shard-end", "1")
        mesh.start_node("node-1", "--model", "tiny-llama", "--shard-start", "2", "--shard-end", "3")
        mesh.wait_routable("tiny-llama", 120)
        endpoint = {n["node_id"]: n["endpoint"] for n in mesh.get("/v1/nodes")["nodes"]}["node-1"]

        # an impostor with the join token and its own key; a stranger without the token
        impostor = mesh.spawn("impostor", ["node", "start", "--tracker", mesh.url, "--node-id", "node-1",
                                           "--state-dir", str(tmp_path / "impostor"), "--threads", "1"],
                              {"MESHNET_JOIN_TOKEN": mesh.join_token})
        stranger = mesh.spawn("stranger", ["node", "start", "--tracker", mesh.url, "--node-id", "node-9",
                                           "--state-dir", str(tmp_path / "stranger"), "--threads", "1"])
        assert impostor.wait(timeout=60) != 0 and stranger.wait(timeout=60) != 0
        for name in ("impostor", "stranger"):
            mesh.procs.pop(name)
        assert "409" in mesh.tail("impostor", 40) and "another key" in mesh.tail("impostor", 40)
        assert "401" in mesh.tail("stranger", 40) and "join token" in mesh.tail("stranger", 40)

        time.sleep(4 * mesh.heartbeat_s)  # the real node-1 keeps heartbeating under its id
        nodes = {n["node_id"]: n["endpoint"] for n in mesh.get("/v1/nodes")["nodes"]}
        assert nodes == {"node-0": nodes["node-0"], "node-1": endpoint}
        resp = httpx.post(f"{mesh.url}/v1/chat/completions", timeout=120,
                          json={"model": "tiny-llama", "messages": ASK, "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text

        # hop traffic needs a session ticket from the tracker (ADR-0038): a stranger's is refused first
        hop = {"X-Meshnet-Session": "s1", "X-Meshnet-Start-Layer": "2", "X-Meshnet-End-Layer": "3"}
        resp = httpx.post(f"{endpoint}/v1/forward", content=b"any bytes", headers=hop, timeout=10)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "ticket_missing"
        resp = httpx.delete(f"{endpoint}/v1/sessions/s1", timeout=10)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "ticket_missing"

        # operator actions need the operator token the mesh was started with
        unpin = {"model": "tiny-llama", "node_id": "node-1"}
        assert httpx.post(f"{mesh.url}/v1/operator/unpin", json=unpin, timeout=10).status_code == 401
        resp = httpx.post(f"{mesh.url}/v1/operator/unpin", json=unpin, timeout=10,
                          headers={"Authorization": f"Bearer {operator}"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "pin_not_found"
    finally:
        mesh.stop()
