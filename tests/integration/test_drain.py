"""SIGTERM drains a node (ADR-0032), with real processes and the real model.

Mesh: two entry nodes (0-9), two middle nodes (10-19), one tail (20-29), float32 end to end
so that tokens are exact. SIGTERM to the node serving a stream, mid-stream: the stream still
ends with ``[DONE]`` and the very tokens of an undisturbed run, the node exits 0 by itself
within its grace and is deregistered at once (the tracker's node timeout is far longer), and
every chat started meanwhile or right after is served by the remaining nodes.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
GRACE_S = 90.0
MAX_TOKENS = 32
SIGTERM_AT_TOKEN = 4


@pytest.fixture(scope="module")
def mesh(real_model_path, tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("drain"))
    try:
        # tests find the node holding a chat by its session count: no speed probes' sessions (ADR-0068)
        m.start_tracker(REAL, extra=["--speed-probe-interval", "0"], node_timeout_s=120.0)  # a node that is gone early was deregistered, not timed out
        shards = {"entry-a": (0, 9), "entry-b": (0, 9), "mid-a": (10, 19), "mid-b": (10, 19), "tail": (20, 29)}
        for name, (a, b) in shards.items():
            m.start_node(name, "--model", REAL, "--shard-start", str(a), "--shard-end", str(b), "--dtype", "float32",
                         "--wire-dtype", "float32", "--drain-grace", str(GRACE_S))
        m.wait(lambda: [(s["end_layer"], s["node_count"]) for s in m.get(f"/v1/coverage/{REAL}")["segments"]]
               == [(19, 2), (29, 1)], 300, "two entries, two middles, one tail")
        yield m
    finally:
        m.stop()


def stream(mesh, max_tokens: int, on_token=None) -> tuple[list[int], dict, list[str]]:
    """A greedy streamed chat through the tracker: (token ids, meshnet block, raw data lines)."""
    return mesh.stream_chat(REAL, STORY, max_tokens, on_token)


def holder_of_the_session(mesh, names: tuple[str, ...]) -> str:
    """Which of ``names`` is on the route of the chat in flight, from the tracker's traffic view
    (a node's own session count would also count an entry's audit replay or a speed probe there)."""
    for session in mesh.get("/v1/traffic")["sessions"]:
        on_route = [h["node_id"] for h in session["route"] if h["node_id"] in names]
        if on_route:
            return on_route[0]
    raise AssertionError(f"none of {names} is on the route of a session in flight")


class ChatsMeanwhile(threading.Thread):
    """Short new chats through the tracker, one after another, until stopped: their statuses."""

    def __init__(self, mesh) -> None:
        super().__init__(daemon=True)
        self.mesh, self.statuses, self.stop = mesh, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            resp = self.mesh.chat(REAL, max_tokens=2)
            self.statuses.append(resp.status_code if resp.status_code == 200 else (resp.status_code, resp.text[:300]))
            self.stop.wait(0.3)


def sigterm_mid_stream(mesh, names: tuple[str, ...]) -> dict:
    """Stream; at SIGTERM_AT_TOKEN send SIGTERM to whichever of ``names`` holds the session.
    Returns what happened, with timings in seconds after the SIGTERM."""
    signalled: dict = {}
    meanwhile = ChatsMeanwhile(mesh)

    def on_token(count: int) -> None:
        if count == SIGTERM_AT_TOKEN and not signalled:
            name = holder_of_the_session(mesh, names)
            proc = mesh.take(name)  # waited for here; mesh.stop() still stops it by PID
            signalled.update(name=name, proc=proc, t=time.monotonic())
            proc.send_signal(signal.SIGTERM)
            meanwhile.start()

    tokens, meta, lines = stream(mesh, MAX_TOKENS, on_token)
    assert signalled, "the SIGTERM did not happen"
    signalled["stream_done_s"] = time.monotonic() - signalled["t"]
    proc = signalled["proc"]
    try:
        proc.wait(timeout=GRACE_S + 15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{signalled['name']} did not exit within its drain grace") from None
    finally:
        meanwhile.stop.set()
        meanwhile.join(timeout=120)
    signalled.update(exit_s=time.monotonic() - signalled["t"], returncode=proc.returncode, tokens=tokens,
                     meta=meta, lines=lines, meanwhile=meanwhile.statuses)
    return signalled


def check_drained(mesh, result: dict, expected: list[int]) -> None:
    name = result["name"]
    print(f"SIGTERM {name}: stream done {result['stream_done_s']:.2f} s later, process exit "
          f"{result['exit_s']:.2f} s later, {len(result['meanwhile'])} new chat(s) meanwhile: {result['meanwhile']}")
    assert result["lines"][-1] == "[DONE]"
    assert result["tokens"] == expected
    assert result["returncode"] == 0
    assert result["exit_s"] < GRACE_S
    assert result["meanwhile"] and all(s == 200 for s in result["meanwhile"]), result["meanwhile"]
    assert name not in [n["node_id"] for n in mesh.get("/v1/nodes")["nodes"]]  # deregistered, not timed out
    after = mesh.chat(REAL, max_tokens=4)
    assert after.status_code == 200, after.text
    assert name not in [h["node_id"] for h in after.json()["meshnet"]["route"]]
    assert mesh.get("/v1/ready").get("ready") is True


def test_sigterm_to_the_entry_node_mid_stream_finishes_the_stream(mesh):
    expected, _, _ = stream(mesh, MAX_TOKENS)
    assert len(expected) == MAX_TOKENS
    result = sigterm_mid_stream(mesh, ("entry-a", "entry-b"))
    check_drained(mesh, result, expected)


def test_sigterm_to_a_middle_node_mid_stream_keeps_its_session(mesh):
    expected, _, _ = stream(mesh, MAX_TOKENS)
    result = sigterm_mid_stream(mesh, ("mid-a", "mid-b"))
    check_drained(mesh, result, expected)
    assert result["meta"]["failovers"] == 0  # the draining node served its session to the end
    assert result["name"] in [h["node_id"] for h in result["meta"]["route"]]


def test_sigterm_to_the_tracker_mid_stream_finishes_the_stream_and_nodes_then_say_not_ready(mesh):
    """The tracker drains too: its proxied stream finishes, a new chat meanwhile is a clear 503
    ``draining``, it exits 0. Its nodes stay alive (health 200) but say why they are not ready."""
    expected, _, _ = stream(mesh, MAX_TOKENS)
    endpoints = {n["node_id"]: n["endpoint"] for n in mesh.get("/v1/nodes")["nodes"]}
    signalled: dict = {}

    def on_token(count: int) -> None:
        if count == SIGTERM_AT_TOKEN and not signalled:
            proc = mesh.take("tracker")  # waited for here; mesh.stop() still stops it by PID
            signalled.update(proc=proc, t=time.monotonic())
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = mesh.chat(REAL, max_tokens=2)
            signalled["refused"] = (refused.status_code, refused.json()["error"]["code"])

    tokens, _, lines = stream(mesh, MAX_TOKENS, on_token)
    stream_done_s = time.monotonic() - signalled["t"]
    assert lines[-1] == "[DONE]" and tokens == expected
    assert signalled["refused"] == (503, "draining")
    assert signalled["proc"].wait(timeout=40) == 0
    exit_s = time.monotonic() - signalled["t"]
    print(f"SIGTERM tracker: stream done {stream_done_s:.2f} s later, process exit {exit_s:.2f} s later")
    unreachable = f"tracker {mesh.url} unreachable"

    def not_ready_for_the_tracker(endpoint: str) -> dict | None:
        resp = httpx.get(f"{endpoint}/v1/ready", timeout=5)
        body = resp.json()
        return body if resp.status_code == 503 and any(r.startswith(unreachable) for r in body["reasons"]) else None

    for name, endpoint in endpoints.items():  # within a few heartbeats (0.5 s each)
        ready = mesh.wait(lambda: not_ready_for_the_tracker(endpoint), 20, f"{name} to say its tracker is gone")
        assert ready["ready"] is False
        assert httpx.get(f"{endpoint}/v1/health", timeout=5).status_code == 200
        if name.startswith("entry"):  # readiness agrees with what a chat there gets
            chat = httpx.post(f"{endpoint}/v1/chat/completions", timeout=60, json={
                "model": REAL, "messages": STORY, "max_tokens": 2, "temperature": 0})
            assert chat.status_code == 503, chat.text
