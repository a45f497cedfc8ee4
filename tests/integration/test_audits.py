"""Decode audits with real processes and the real model (ADR-0067).

The entry holds layers 0-9, ``tail`` 20-29; three nodes hold the middle range 10-19: ``h1`` and
``h2`` honestly, ``x-bad`` with noise of 0.1 x the weight's std on layer 15's MLP down-projection
(the issue's acceptance case; test-only, ``tests/corrupt.py``), in one of two ways: only on decode
steps (honest on every prefill: its admission challenge, spot-checks), or only on the steps that
come over hop streams (honest on every ``POST /v1/forward``: challenges, witness replays). It claims
ten times its speed so that routes take it. Everything else is at its default: the entry audits a
share of its sessions, more while a hop is on probation.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
SHORT = [{"role": "user", "content": "Count from one to ten."}]
BF16 = ("--dtype", "bfloat16", "--wire-dtype", "bfloat16")
MIDDLE = ("--model", REAL, "--shard-start", "10", "--shard-end", "19", *BF16)


def node_view(mesh: Mesh, name: str) -> dict:
    """The tracker's view of node ``name`` (KeyError while it is not registered: "not yet" to a wait)."""
    return {n["node_id"]: n for n in mesh.get("/v1/nodes")["nodes"]}[name]


def admitted(mesh: Mesh, name: str) -> bool:
    shards = node_view(mesh, name)["shards"]
    return bool(shards) and (shards[0].get("verification") or {}).get("state") in ("verified", "unverified")


def start_routable(mesh: Mesh) -> None:
    """The tracker, ``entry`` (0-9), ``tail`` (20-29) and the honest ``h1`` (10-19), until routable."""
    # routes are steered by claimed speeds (test-only): the tracker's speed probes (ADR-0068) are off
    mesh.start_tracker(REAL, node_timeout_s=10.0, extra=["--speed-probe-interval", "0"])
    mesh.start_node("entry", "--model", REAL, "--shard-start", "0", "--shard-end", "9", *BF16)
    mesh.start_node("tail", "--model", REAL, "--shard-start", "20", "--shard-end", "29", *BF16)
    mesh.start_node("h1", *MIDDLE)
    mesh.wait_routable(REAL, 240)


LIES = {"decode": {"MESHNET_TEST_CORRUPT_DECODE_WEIGHTS": "0.1", "MESHNET_TEST_CORRUPT_LAYER": "15"},
        "streams": {"MESHNET_TEST_CORRUPT_STREAMS_WEIGHTS": "0.1", "MESHNET_TEST_CORRUPT_LAYER": "15"},
        # lying on decode steps and keeping no transcript: audited on the frames its neighbours kept
        "decode-withholding": {"MESHNET_TEST_CORRUPT_DECODE_WEIGHTS": "0.1", "MESHNET_TEST_CORRUPT_LAYER": "15",
                               "MESHNET_TEST_WITHHOLD_TRANSCRIPTS": "1"}}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_node_lying_only_where_it_thinks_no_one_checks_is_caught_by_an_audit_and_quarantined(
        lie, real_model_path, tmp_path):
    mesh = Mesh(tmp_path)
    try:
        start_routable(mesh)
        mesh.start_node("x-bad", *MIDDLE, env={**LIES[lie], "MESHNET_TEST_CLAIM_SPEED": "10"},
                        module="tests.corrupt")  # claims to be fastest, so routes go through it
        mesh.wait(lambda: admitted(mesh, "x-bad"), 180, "x-bad admitted")  # honest for its challenge
        mesh.start_node("h2", *MIDDLE)
        mesh.wait(lambda: admitted(mesh, "h2"), 180, "h2 admitted")

        answers, through_bad, quarantine, caught_after = [], 0, None, None
        for _ in range(80):
            resp = mesh.chat(REAL, SHORT, max_tokens=8)
            assert resp.status_code == 200, resp.text
            route = [h["node_id"] for h in resp.json()["meshnet"]["route"]]
            answers.append((time.time(), route))
            through_bad += "x-bad" in route
            if quarantine is None:
                quarantine = node_view(mesh, "x-bad")["quarantine"]
                if not quarantine and through_bad:  # the audit runs after its session: give it its time
                    time.sleep(1.0)
                    quarantine = node_view(mesh, "x-bad")["quarantine"]
                caught_after = through_bad if quarantine else None
            elif len(answers) >= 5 + next(i for i, (t, _) in enumerate(answers) if t > quarantine["since"]):
                break
        assert quarantine, f"x-bad not quarantined after {len(answers)} requests, {through_bad} through it"
        print(f"x-bad quarantined after {caught_after} request(s) through it: {quarantine}")
        assert caught_after <= 50
        # the entry's dispute of x-bad, or x-bad outvoted as a witness of the tracker's re-run of a
        # dispute (it lies to that too): either way on the tracker's own measurements
        assert quarantine["reported_by"] in ("entry", "tracker (outvoted as an audit witness)"), quarantine
        assert set(quarantine["witnesses"]) == {"h1", "h2"}
        distance = {frozenset(pair.split("|")): d for pair, d in quarantine["distances"].items()}
        assert distance[frozenset({"h1", "h2"})] <= quarantine["tolerance"] == 0.018 < min(
            distance[frozenset({"x-bad", "h1"})], distance[frozenset({"x-bad", "h2"})])
        late = [route for finished, route in answers if finished > quarantine["since"] + 2.0]
        assert late and all("x-bad" not in route for route in late)
        for name in ("h1", "h2", "entry", "tail"):
            assert node_view(mesh, name)["quarantine"] is None, name
        audits = httpx.get(f"{node_view(mesh, 'entry')['endpoint']}/v1/health", timeout=5).json()["audits"]
        print(f"entry audits: {audits}")
        if "withholding" in lie:  # every audit of x-bad found no transcript and rebuilt it from entry's and tail's frames
            assert audits["withheld"] == audits["rebuilt"] >= 1 and audits["mismatched"] == 0
        else:
            assert audits["withheld"] == 0 and audits["mismatched"] == 0
        assert any(v.get("verdict") in ("quarantine", "witness_outvoted") for v in audits["verdicts"])
        assert max(audits["distances"]) > quarantine["tolerance"]
    finally:
        mesh.stop()


def test_a_witness_that_lies_to_an_entrys_audit_is_quarantined_by_its_signed_replay_and_the_entry_is_not(
        real_model_path, tmp_path):
    """ADR-0067 (amended 2026-12-07). ``r-bad`` computes honestly everywhere but in the replays it
    runs for an entry's audits (0.5 x std on layer 15's weights there), so that the entry's audits of
    the honest hop it witnesses for come out far: each dispute would count as a false accusation
    against the honest entry (quarantined at the third). The tracker weighs the witness's own
    signed replay: r-bad is quarantined, the entry's dispute counts as upheld. Routes are steered by
    claimed speeds (test-only): ``fast`` (honest, 10 x) takes the sessions, r-bad (5 x) is the
    next holder, so the entry's witness; h1 and h2 are left for the tracker's re-run."""
    mesh = Mesh(tmp_path)
    try:
        start_routable(mesh)
        mesh.start_node("fast", *MIDDLE, env={"MESHNET_TEST_CLAIM_SPEED": "10"}, module="tests.corrupt")
        mesh.start_node("r-bad", *MIDDLE, env={"MESHNET_TEST_CORRUPT_REPLAYS_WEIGHTS": "0.5",
                                               "MESHNET_TEST_CORRUPT_LAYER": "15", "MESHNET_TEST_CLAIM_SPEED": "5"},
                        module="tests.corrupt")
        mesh.start_node("h2", *MIDDLE)
        for name in ("fast", "r-bad", "h2"):
            mesh.wait(lambda name=name: admitted(mesh, name), 180, f"{name} admitted")

        quarantine, answers = None, 0
        for answers in range(1, 41):
            resp = mesh.chat(REAL, SHORT, max_tokens=8)
            assert resp.status_code == 200, resp.text
            time.sleep(1.0)  # the audit runs after its session
            quarantine = node_view(mesh, "r-bad")["quarantine"]
            if quarantine:
                break
        assert quarantine, f"r-bad not quarantined after {answers} requests"
        print(f"r-bad quarantined after {answers} request(s): {quarantine}")
        assert quarantine["reported_by"] == "tracker (its signed replay for an entry's audit outvoted)"
        assert set(quarantine["witnesses"]) >= {"h1", "h2"}
        entry = node_view(mesh, "entry")
        assert entry["quarantine"] is None and entry["accusations"]["false"] == 0
        assert entry["accusations"]["upheld"] >= 1
        for name in ("fast", "h1", "h2", "tail"):
            assert node_view(mesh, name)["quarantine"] is None, name
        audits = httpx.get(f"{entry['endpoint']}/v1/health", timeout=5).json()["audits"]
        print(f"entry audits: {audits}")
        assert any(v.get("verdict") == "replay_outvoted" and v.get("outvoted") == "r-bad" for v in audits["verdicts"])
        assert audits["unsigned"] == 0
    finally:
        mesh.stop()
