"""Admission challenges and spot-checks with real processes and the real model (ADR-0042).

The entry holds layers 0-9; three nodes hold 10-29: ``h1`` and ``h2`` honestly, ``x-bad``
honest for its admission challenge and then with noise on layer 15's MLP down-projection
(``MESHNET_TEST_CORRUPT_LAYER``, test-only). The entry checks a quarter of its sessions, with
audits off (ADR-0067: an audit may catch the same node first, as a witness of the tracker's re-run).
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
SHORT = [{"role": "user", "content": "Say hi."}]
BF16 = ("--dtype", "bfloat16", "--wire-dtype", "bfloat16")
HOLDERS = ("--model", REAL, "--shard-start", "10", "--shard-end", "29", *BF16)


def node_view(mesh: Mesh, name: str) -> dict:
    return next(n for n in mesh.get("/v1/nodes")["nodes"] if n["node_id"] == name)


def verification(mesh: Mesh, name: str) -> dict:
    """The node's shard verification once the tracker decided it (bounded wait)."""
    def decided():
        shards = node_view(mesh, name)["shards"] if any(n["node_id"] == name for n in mesh.get("/v1/nodes")["nodes"]) \
            else []
        v = shards[0].get("verification") if shards else None
        return v if v is not None and v["state"] != "pending" else None
    return mesh.wait(decided, 180, f"{name}'s shard verified or rejected")


def test_a_node_that_turns_dishonest_is_quarantined_and_serves_no_later_answer(real_model_path, tmp_path):
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker(REAL, node_timeout_s=10.0)
        mesh.start_node("entry", "--model", REAL, "--shard-start", "0", "--shard-end", "9", *BF16,
                        env={"MESHNET_SPOT_CHECK_RATE": "0.25", "MESHNET_AUDIT_RATE": "0"})  # spot-checks alone
        mesh.start_node("h1", *HOLDERS)
        mesh.wait_routable(REAL, 240)
        first = verification(mesh, "h1")  # the first holder: checked against the model's own files (ADR-0070)
        assert first["state"] == "verified" and first["references"] == ["@source"], first
        assert first["distances"]["h1|@source"] <= first["tolerance"] == 0.05
        mesh.start_node("h2", *HOLDERS)
        honest = verification(mesh, "h2")
        assert honest["state"] == "verified" and honest["references"] == ["@source"]
        mesh.start_node("x-bad", *HOLDERS, env={"MESHNET_TEST_CORRUPT_LAYER": "15", "MESHNET_TEST_CORRUPT_AFTER": "1"},
                        module="tests.corrupt")  # the test's dishonest wrapper of meshnet
        assert verification(mesh, "x-bad")["state"] == "verified"  # honest for its challenge
        print(f"admission challenge distances: h1 {first['distances']}, h2 {honest['distances']}, "
              f"x-bad {node_view(mesh, 'x-bad')['shards'][0]['verification']['distances']}")

        answers, quarantine, quarantine_at = [], None, 0
        for _ in range(60):
            resp = mesh.chat(REAL, SHORT, max_tokens=4)
            assert resp.status_code == 200, resp.text
            assert resp.json()["meshnet"]["verified"] is True  # every shard checked against the files (ADR-0070)
            answers.append((time.time(), [h["node_id"] for h in resp.json()["meshnet"]["route"]]))
            if quarantine is None:
                quarantine = node_view(mesh, "x-bad")["quarantine"]
                quarantine_at = len(answers)
            elif len(answers) >= quarantine_at + 5:
                break
        assert quarantine is not None, f"x-bad not quarantined after {len(answers)} requests"
        print(f"x-bad quarantined after {quarantine_at} request(s): {quarantine}")
        assert quarantine_at <= 50
        assert set(quarantine["witnesses"]) == {"h1", "h2"} and quarantine["reported_by"] == "entry"
        honest_pair = [d for pair, d in quarantine["distances"].items() if "x-bad" not in pair]
        dishonest = [d for pair, d in quarantine["distances"].items() if "x-bad" in pair]
        assert honest_pair[0] <= quarantine["tolerance"] < min(dishonest)
        late = [route for finished, route in answers if finished > quarantine["since"]]
        assert late and all("x-bad" not in route for route in late)
        assert node_view(mesh, "h1")["quarantine"] is None and node_view(mesh, "h2")["quarantine"] is None
        stats = httpx.get(f"{node_view(mesh, 'entry')['endpoint']}/v1/health", timeout=5).json()["spot_checks"]
        print(f"entry spot-checks: {stats['checks']} checks, distances {sorted(stats['distances'])}")
        assert stats["quarantined"] == ["x-bad"]
        route = mesh.get(f"/v1/route?model={REAL}&start_layer=10&end_layer=29")
        assert route["hops"][0]["node_id"] in ("h1", "h2")
    finally:
        mesh.stop()
