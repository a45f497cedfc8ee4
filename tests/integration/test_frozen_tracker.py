"""A leader that stops answering without dying (SIGSTOP: a process frozen by the OS or a
debugger, a paused VM) on one PostgreSQL database with a standby (ADR-0054).

While the leader is frozen, the node that served the model dies and a model-less node joins,
given both tracker URLs with the frozen one first. Then: the standby takes the lease and places
the newcomer; the node's registration and heartbeats move to the standby after one answer
deadline; `meshnet chat --url frozen,standby` answers; and when the frozen leader is resumed it
finds the lease gone, says so, and issues nothing; the registration the node had sent it before
moving on, which waited in its socket, is refused rather than undoing the node's record.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

from meshnet.client import ANSWER_DEADLINE_S
from meshnet.tracker.pgstore import LEASE_S
from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow


def rows(url: str, sql: str) -> list[dict]:
    with psycopg.connect(url, row_factory=dict_row) as conn:
        return conn.execute(sql).fetchall()


def health(url: str) -> dict:
    return httpx.get(f"{url}/v1/health", timeout=2).json()


def test_a_frozen_leader_is_replaced_its_clients_move_on_and_it_issues_nothing_when_resumed(real_model_path, pg_url,
                                                                                            tmp_path):
    mesh = Mesh(tmp_path, heartbeat_s=0.5)
    try:
        a = mesh.start_tracker(REAL, db=pg_url, node_timeout_s=4.0, rebalance_s=2.0, name="tracker")
        mesh.wait(lambda: health(a)["leader"], 15, "tracker a leads")
        b = mesh.start_tracker(REAL, db=pg_url, node_timeout_s=4.0, rebalance_s=2.0, name="tracker-b")
        mesh.start_node("n1", "--dtype", "float32")  # model-less: the leader places the model on it
        assert mesh.wait_routable(REAL, 240)["covered_layers"] == 30
        assert (health(a)["leader"], health(b)["leader"]) == (True, False)
        assert rows(pg_url, "SELECT holder, term FROM tracker_lease")[0]["term"] == 1

        mesh.signal("tracker", signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert mesh.kill("n1") == -9  # the only holder of the model dies ...
        mesh.start_node("n2", "--dtype", "float32")  # ... and a model-less node joins, a's URL first
        mesh.wait(lambda: health(b)["leader"], 10, "tracker-b leads", interval_s=0.1)
        led_s = time.monotonic() - frozen_at
        load = mesh.wait(lambda: rows(pg_url, "SELECT id, created_at FROM directives WHERE node_id = 'n2' "
                                              "AND type = 'LOAD_SHARD'"), 30, "a LOAD_SHARD for n2", interval_s=0.1)
        placed_s = time.monotonic() - frozen_at
        print(f"standby led {led_s:.2f} s and placed n2 {placed_s:.2f} s after the leader froze")
        assert led_s < 10 and placed_s < 15
        assert rows(pg_url, "SELECT term FROM tracker_lease")[0]["term"] == 2
        assert len(load) == 1

        mesh.url = b
        assert mesh.wait_routable(REAL, 240)["covered_layers"] == 30
        # a client given both URLs, the frozen one first, answers after one deadline at most
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "chat", "What is the capital of France?",
                               "--url", f"{a},{b}", "--no-stream", "--max-tokens", "8"],
                              capture_output=True, text=True, timeout=120)
        chat_s = time.monotonic() - started
        print(f"meshnet chat --url frozen,standby: {chat_s:.2f} s, rc {done.returncode}: {done.stdout.strip()!r}")
        assert done.returncode == 0, done.stderr
        assert "Paris" in done.stdout
        # n2's heartbeats go to the standby: it stays listed there well past the dropout timeout
        time.sleep(5.0)
        listed = {n["node_id"] for n in httpx.get(f"{b}/v1/nodes", timeout=5).json()["nodes"]}
        assert listed == {"n2"}
        assert f"{a} did not answer" in mesh.tail("n2", 400)

        directives_before = rows(pg_url, "SELECT id, node_id, type, reason FROM directives ORDER BY id")
        mesh.signal("tracker", signal.SIGCONT)
        resumed_at = time.monotonic()
        mesh.wait(lambda: "lost the lease (term 1)" in mesh.tail("tracker", 200), 10,
                  "the resumed tracker says it lost the lease")
        print(f"the resumed leader stood down {time.monotonic() - resumed_at:.2f} s after SIGCONT")
        time.sleep(LEASE_S)
        assert (health(a)["leader"], health(b)["leader"]) == (False, True)
        after = rows(pg_url, "SELECT id, node_id, type, reason FROM directives ORDER BY id")
        assert after == directives_before  # nothing queued since the resume, by either tracker
        # the registration n2 sent to it before moving on waited in its socket: refused, not applied
        assert "refused a call of n2" in mesh.tail("tracker", 200)
        assert {n["node_id"]: len(n["shards"]) for n in httpx.get(f"{b}/v1/nodes", timeout=5).json()["nodes"]} == {
            "n2": 1}
        assert rows(pg_url, "SELECT term FROM tracker_lease")[0]["term"] == 2
        assert ANSWER_DEADLINE_S < chat_s < ANSWER_DEADLINE_S + 60
    finally:
        mesh.stop()
