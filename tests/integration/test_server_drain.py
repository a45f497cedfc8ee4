"""The uvicorn runner (meshnet.cli.server) with a real process and real signals, no model:
SIGTERM drains (the stream in flight finishes whole, the process exits 0), a second SIGTERM
cuts the stream with an error event and stops at once, and a SIGTERM while the app starts still drains once started."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.mesh import free_port

#: an app streaming EVENTS events STEP_S apart; its lifespan takes STARTUP_S; drain grace GRACE_S
APP = """
import asyncio, sys
from contextlib import asynccontextmanager
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route
from meshnet.cli.server import serve
from meshnet.drain import Drain, DrainMiddleware, EventStream

port, startup_s, grace_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
drain = Drain(grace_s)

async def leave():
    print("left", flush=True)

async def chat(request):
    async def events():
        for i in range(20):
            await asyncio.sleep(0.1)
            yield f"data: {i}\\n\\n"
        yield "data: [DONE]\\n\\n"
    return EventStream(events())

@asynccontextmanager
async def lifespan(app):
    print("starting", flush=True)  # uvicorn has taken over the exit signals by now
    await asyncio.sleep(startup_s)
    drain.leave = leave
    print("started", flush=True)
    yield

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan,
                middleware=[Middleware(DrainMiddleware, drain=drain)])
serve(app, "127.0.0.1", port, drain=drain)
"""


@pytest.fixture
def start(tmp_path):
    procs = []

    def run(startup_s: float = 0.0, grace_s: float = 30.0) -> tuple[subprocess.Popen, str]:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.Popen([sys.executable, "-c", APP, str(port), str(startup_s), str(grace_s)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    yield run
    for proc in procs:  # stopped by PID
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.post(f"{url}/v1/chat/completions", timeout=5, json={}).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("the app did not come up")


def stream_with_signals(url: str, proc: subprocess.Popen, signals_at: dict[int, int]) -> list[str]:
    lines = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={}, timeout=30) as resp:
        try:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) in signals_at:
                        proc.send_signal(signals_at[len(lines)])
        except httpx.HTTPError:
            lines.append("<cut>")
    return lines


def test_sigterm_lets_the_stream_finish_then_exits_0(start):
    proc, url = start()
    wait_up(url)
    lines = stream_with_signals(url, proc, {3: signal.SIGTERM})
    assert lines[-1] == "[DONE]" and len(lines) == 21
    assert proc.wait(timeout=15) == 0
    assert b"left" in proc.stdout.read()


def test_a_second_sigterm_skips_the_drain(start):
    proc, url = start()
    wait_up(url)
    t0 = time.monotonic()
    lines = stream_with_signals(url, proc, {3: signal.SIGTERM, 5: signal.SIGTERM})
    assert "[DONE]" not in lines and len(lines) < 10
    assert json.loads(lines[-1])["error"]["code"] == "draining"
    assert proc.wait(timeout=15) == -signal.SIGTERM
    assert time.monotonic() - t0 < 5


def read_until(proc: subprocess.Popen, marker: bytes, timeout_s: float) -> bytes:
    """The process's output up to and including the line holding ``marker`` (bounded wait)."""
    out, deadline = b"", time.monotonic() + timeout_s
    while marker not in out:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"no {marker!r} within {timeout_s} s; output so far: {out!r}")
        out += line
    return out


def test_sigterm_while_starting_drains_once_started(start):
    # the signal must come after the interpreter's imports (before them it is SIGTERM's default
    # action, whatever the app does): the lifespan's first line says the signals are taken
    proc, url = start(startup_s=1.5)
    out = read_until(proc, b"starting", 30)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    out += proc.stdout.read()
    assert b"started" in out and b"left" in out
