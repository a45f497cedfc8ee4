"""An event loop never computes (ADR-0049), on every topology a user gets from ``meshnet serve``:
one process (the tracker holds all 30 layers), a tracker without layers in front of one node, and
a tracker with two nodes (three hops). A streamed 100-token generation arrives spread out, token by
token, and ``GET /v1/health`` of the process the chat entered answers within a second all along.

Real processes on 127.0.0.1, real SmolLM2, float32 with one torch thread per process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from meshnet.models.sources import cache_dir
from tests.integration.conftest import REAL
from tests.integration.mesh import free_port

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
TOKENS = 100
#: health is asked this often while the generation runs, seconds
HEALTH_EVERY_S = 0.1


class Serve:
    """``meshnet serve`` in its own process, stopped (SIGTERM, then SIGKILL) by its PID."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", "serve", "--port", str(self.port), "--dtype", "float32",
             "--wire-dtype", "float32", "--threads", "1", "--heartbeat-interval", "1", "--drain-grace", "3", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ}, start_new_session=True)
        self.lines: list[str] = []

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if line.startswith("READY"):
                threading.Thread(target=self._drain_output, daemon=True).start()
                return
        raise AssertionError("meshnet serve did not get ready:\n" + "".join(self.lines[-30:]))

    def _drain_output(self) -> None:
        for line in self.proc.stdout:  # keeps the pipe from filling up; ends when the process does
            self.lines.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def stream_with_health(url: str, health_url: str) -> tuple[float, list[float], list[float]]:
    """A greedy streamed ``TOKENS``-token chat at ``url`` while another thread asks ``health_url``
    every :data:`HEALTH_EVERY_S`. Returns (seconds from sending the request to the last content
    chunk, each content chunk's arrival in seconds from sending, each health answer's latency)."""
    latencies: list[float] = []
    statuses: list[int] = []  # checked by the caller: an assertion in this thread would fail nothing
    done = threading.Event()

    def ask_health() -> None:
        with httpx.Client(timeout=5) as client:
            for _ in range(3000):  # bounded: 300 s at most
                if done.is_set():
                    return
                t0 = time.perf_counter()
                statuses.append(client.get(health_url).status_code)
                latencies.append(time.perf_counter() - t0)
                time.sleep(HEALTH_EVERY_S)

    body = {"model": REAL, "messages": STORY, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    arrivals: list[float] = []
    asker = threading.Thread(target=ask_health, daemon=True)
    t0 = time.perf_counter()
    asker.start()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else None
                if choices and choices[0]["delta"].get("content"):
                    arrivals.append(time.perf_counter() - t0)
    finally:
        done.set()
        asker.join(10)
    assert statuses and set(statuses) == {200}, statuses
    return arrivals[-1], arrivals, latencies


def check_spread_and_health(serve: Serve, health_url: str) -> None:
    total_s, arrivals, latencies = stream_with_health(serve.url, health_url)
    span = arrivals[-1] - arrivals[0]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    print(f"{len(arrivals)} content chunks over {span:.2f} s of {total_s:.2f} s; longest gap {max(gaps):.3f} s; "
          f"{len(latencies)} health answers, worst {max(latencies) * 1000:.1f} ms")
    assert len(arrivals) >= TOKENS * 0.9  # one chunk per token (a few tokens may share a chunk's text)
    assert span >= total_s / 2, (span, total_s)
    assert max(gaps) <= span / 5, (max(gaps), span)
    assert len(latencies) >= 5 and max(latencies) < 1.0, latencies


@pytest.mark.parametrize("nodes", ["1", "3"])
def test_a_stream_arrives_token_by_token_and_health_answers_throughout(real_model_path, nodes):
    """One process (the tracker holds all 30 layers: its own entry runs every step) and three
    processes (the tracker holds layers 0-9 and is the entry)."""
    serve = Serve("--nodes", nodes)
    try:
        serve.wait_ready()
        check_spread_and_health(serve, f"{serve.url}/v1/health")
    finally:
        serve.stop()


def test_through_the_trackers_proxy_streams_spread_out_and_a_client_that_leaves_stops_the_work(real_model_path):
    """A tracker without layers in front of one node holding all 30: the stream through its proxy
    arrives spread out while both processes answer health; a non-streamed chat whose client hangs
    up is cancelled at the entry (its sessions go to 0 long before the generation would end), and
    the entry is not reported as failed."""
    serve = Serve("--nodes", "1", "--no-tracker-layers")
    try:
        serve.wait_ready()
        (node,) = httpx.get(f"{serve.url}/v1/nodes", timeout=10).json()["nodes"]
        check_spread_and_health(serve, f"{node['endpoint']}/v1/health")
        check_spread_and_health(serve, f"{serve.url}/v1/health")

        body = {"model": REAL, "messages": STORY, "max_tokens": 700, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 2 s of a ~20 s generation
            httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(2.0, connect=5.0))
        left = time.monotonic()
        health = f"{node['endpoint']}/v1/health"
        deadline = left + 3
        while httpx.get(health, timeout=5).json()["sessions"] > 0:
            assert time.monotonic() < deadline, "the entry still generates for a client that left"
            time.sleep(0.1)
        print(f"entry at 0 sessions {time.monotonic() - left:.2f} s after the client left")
        tracker_log = (cache_dir() / "logs" / "tracker.log").read_text(errors="replace")
        assert "hop failure reported for" not in tracker_log  # the healthy entry was not blamed
        assert httpx.get(f"{serve.url}/v1/ready", timeout=10).status_code == 200
    finally:
        serve.stop()
