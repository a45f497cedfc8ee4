"""Two tracker processes on one PostgreSQL database; the leader is killed with SIGKILL while the
directives of its rebalance are being carried out (ADR-0043).

Nodes are given both URLs and start without shards, so the leader plans every load. It is
killed once its LOAD_SHARDs are in the database and before the nodes have finished them. Then:
the standby leads within 10 s; every pin, directive and demand row from before the kill is still
there; no node got a LOAD_SHARD twice; and a chat through the survivor answers.
"""

from __future__ import annotations

import time

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow


def rows(url: str, sql: str) -> list[dict]:
    with psycopg.connect(url, row_factory=dict_row) as conn:
        return conn.execute(sql).fetchall()


def leader(url: str) -> bool:
    return httpx.get(f"{url}/v1/health", timeout=2).json()["leader"]


def test_killing_the_leader_mid_rebalance_loses_nothing_and_loads_nothing_twice(real_model_path, pg_url, tmp_path):
    mesh = Mesh(tmp_path, heartbeat_s=0.5)
    try:
        a = mesh.start_tracker(REAL, db=pg_url, node_timeout_s=5.0, rebalance_s=2.0, name="tracker")
        mesh.wait(lambda: leader(a), 15, "tracker a leads")
        b = mesh.start_tracker(REAL, db=pg_url, node_timeout_s=5.0, rebalance_s=2.0, name="tracker-b")
        time.sleep(1.5)  # b has tried for the lock at least once
        assert (leader(a), leader(b)) == (True, False)

        # demand before anything is served: refused at the standby, stored for the leader
        refused = httpx.post(f"{b}/v1/chat/completions", timeout=30, json={
            "model": REAL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert refused.status_code == 503

        for name in ("n1", "n2"):  # no shard flags: the leader plans what they load
            mesh.start_node(name, "--dtype", "float32")
        mesh.wait(lambda: len(httpx.get(f"{a}/v1/nodes", timeout=5).json()["nodes"]) == 2, 120, "both nodes at a")
        pinned = httpx.post(f"{a}/v1/operator/pin", timeout=30, json={"model": REAL, "node_id": "n2", "shard": "0-29"})
        assert pinned.status_code == 200, pinned.text

        # the leader's loads are in the database, not yet done: kill it now
        mesh.wait(lambda: rows(pg_url, "SELECT id FROM directives WHERE type = 'LOAD_SHARD' AND node_id = 'n1'"),
                  60, "a LOAD_SHARD for n1", interval_s=0.05)
        before = {name: rows(pg_url, f"SELECT * FROM {name}") for name in ("pins", "directives", "demand")}
        assert [d["status"] for d in before["directives"] if d["status"] == "done"] == []
        print("directives at the kill:", [(d["node_id"], d["type"], d["shard_start"], d["shard_end"], d["status"])
                                          for d in before["directives"]])
        assert mesh.kill("tracker") == -9
        killed_at = time.monotonic()
        mesh.wait(lambda: leader(b), 10, "tracker-b leads", interval_s=0.1)
        took_s = time.monotonic() - killed_at
        print(f"standby led {took_s:.2f} s after the SIGKILL of the leader")
        assert took_s < 10

        # the nodes move to b and finish their loads there
        mesh.url = b
        coverage = mesh.wait_routable(REAL, 240)
        assert coverage["covered_layers"] == 30
        after = {name: rows(pg_url, f"SELECT * FROM {name}") for name in ("pins", "directives", "demand")}
        assert after["pins"] == before["pins"]
        assert {r["id"] for r in before["demand"]} <= {r["id"] for r in after["demand"]}
        assert [r["kind"] for r in before["demand"]] == ["refused"]
        kept = {d["id"]: d for d in after["directives"]}
        for d in before["directives"]:
            assert d["id"] in kept and {k: kept[d["id"]][k] for k in ("node_id", "type", "model", "shard_start",
                                                                        "shard_end")} == {
                k: d[k] for k in ("node_id", "type", "model", "shard_start", "shard_end")}
        loads = [(d["node_id"], d["model"], d["shard_start"], d["shard_end"]) for d in after["directives"]
                 if d["type"] == "LOAD_SHARD"]
        assert len(loads) == len(set(loads)), f"a LOAD_SHARD was issued twice: {sorted(loads)}"
        assert not [d for d in after["directives"] if d["type"] == "LOAD_SHARD" and d["status"] == "failed"]
        assert ("n2", REAL, 0, 29) in loads

        resp = mesh.chat(REAL, max_tokens=8)  # through the survivor
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"].strip()
        assert httpx.get(f"{b}/v1/demand", timeout=5).json()["demand"][0]["requests_per_min"] > 0
    finally:
        mesh.stop()
