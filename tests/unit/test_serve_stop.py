"""`meshnet serve` stops its children in order: the tracker drains and exits before the nodes get SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time

from meshnet.cli.serve import stop_all

#: a child that records when SIGTERM came, takes ``delay`` s to drain, then exits 0
CHILD = """
import signal, sys, time
def on_term(sig, frame):
    open(sys.argv[1], "w").write(repr(time.time()))
    time.sleep(float(sys.argv[2]))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
while True:
    time.sleep(0.05)
"""


def spawn(path, delay_s: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(delay_s)], stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\n"
    return p


def test_the_tracker_exits_before_the_nodes_are_signalled(tmp_path):
    tracker = spawn(tmp_path / "tracker", 0.4)
    nodes = [spawn(tmp_path / f"node{i}", 0.1) for i in range(2)]
    stop_all([[tracker], nodes], grace_s=10.0)
    tracker_term = float((tmp_path / "tracker").read_text())
    node_terms = [float((tmp_path / f"node{i}").read_text()) for i in range(2)]
    assert all(t >= tracker_term + 0.4 for t in node_terms)
    assert [p.returncode for p in [tracker, *nodes]] == [0, 0, 0]


def test_a_child_that_outlives_the_grace_is_killed(tmp_path):
    stuck = spawn(tmp_path / "stuck", 30.0)
    t0 = time.monotonic()
    stop_all([[stuck]], grace_s=0.5)
    assert time.monotonic() - t0 < 5 and stuck.returncode == -9
