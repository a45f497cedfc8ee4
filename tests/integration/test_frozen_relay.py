"""A relayed node whose relay, a tracker, stops answering without dying (SIGSTOP) moves to the
relay of the tracker that answers (ADR-0045 amendment, ADR-0054).

Two trackers on one PostgreSQL database; a node reachable only through a relay (``--relay``),
given both tracker URLs with the first one first, attaches its tunnel to the first. The first
tracker is frozen: the node's calls move to the second after one answer deadline, its tunnel to
the frozen one drops at the keepalive, and it attaches to the second's relay and registers that
endpoint, through which the second tracker reaches it. No model is needed: the node holds none.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow

#: the most seconds the move may take: one answer deadline (3 s) for the heartbeat, the keepalive
#: (2 + 4 s), the close handshake the frozen peer never answers (websockets waits 10 s) and
#: TRACKER_RELAY_FALLBACK_S (1 s) for the tunnel, a heartbeat round, the re-attach and the new
#: endpoint's probe
MOVE_S = 40.0


def node_at(tracker: str, node_id: str) -> dict | None:
    nodes = httpx.get(f"{tracker}/v1/nodes", timeout=2).json()["nodes"]
    return next((n for n in nodes if n["node_id"] == node_id), None)


def test_a_node_relayed_by_a_frozen_tracker_moves_to_the_relay_of_the_one_that_answers(pg_url, tmp_path):
    mesh = Mesh(tmp_path, heartbeat_s=0.5)
    try:
        a = mesh.start_tracker(db=pg_url, node_timeout_s=8.0, name="tracker")
        b = mesh.start_tracker(db=pg_url, node_timeout_s=8.0, name="tracker-b")
        mesh.start_node("n1", "--relay")
        relayed_at_a = mesh.wait(lambda: (n := node_at(a, "n1")) and n["reachable"]
                                 and n["endpoint"] == f"{a}/v1/relay/n1" and n, 60, "n1 reachable through a's relay")
        assert relayed_at_a["endpoint"] == f"{a}/v1/relay/n1"

        mesh.signal("tracker", signal.SIGSTOP)
        frozen_at = time.monotonic()
        moved = mesh.wait(lambda: (n := node_at(b, "n1")) and n["endpoint"] == f"{b}/v1/relay/n1"
                          and n["reachable"] and n, MOVE_S, "n1 reachable through b's relay", interval_s=0.2)
        moved_s = time.monotonic() - frozen_at
        print(f"n1 was reachable through the answering tracker's relay {moved_s:.1f} s after its relay froze")
        assert moved["endpoint"] == f"{b}/v1/relay/n1"
        health = httpx.get(f"{b}/v1/relay/n1/v1/health", timeout=5)
        assert health.status_code == 200 and health.json()["node_id"] == "n1"
        assert f"moving to the relay of {b}" in mesh.tail("n1", 400)
    finally:
        mesh.signal("tracker", signal.SIGCONT)
        mesh.stop()
