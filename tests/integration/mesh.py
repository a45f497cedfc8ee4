"""Real meshnet processes on 127.0.0.1 for integration tests: start, wait, stop by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from meshnet.endpoints import base_url
from meshnet.endpoints import free_port as _free_port_on

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` (IPv4 or IPv6) right now."""
    return _free_port_on(host)


class Mesh:
    """A tracker plus nodes, each a real ``python -m meshnet.cli.main`` process.

    Every process started here is stopped by its PID in :meth:`stop` (SIGTERM, then SIGKILL).
    """

    def __init__(self, log_dir: Path, *, heartbeat_s: float = 0.5) -> None:
        self.log_dir = log_dir
        self.heartbeat_s = heartbeat_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = free_port()
        self.url = base_url("127.0.0.1", self.port)

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        env = {**os.environ, "MESHNET_LOG_LEVEL": "INFO", **(env or {})}
        proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def start_tracker(self, *models: str, node_timeout_s: float = 3.0, rebalance_s: float = 2.0,
                      extra: list[str] | None = None) -> None:
        args = ["tracker", "start", "--port", str(self.port), "--db", str(self.log_dir / "tracker.db"),
                "--heartbeat-interval", str(self.heartbeat_s), "--node-timeout", str(node_timeout_s),
                "--rebalance-interval", str(rebalance_s)]
        for m in models:
            args += ["--model", m]
        self._spawn("tracker", args + (extra or []))
        self.wait(lambda: httpx.get(f"{self.url}/v1/health", timeout=1).status_code == 200, 30, "tracker up")

    def start_node(self, name: str, *args: str, env: dict | None = None) -> None:
        self._spawn(name, ["node", "start", "--tracker", self.url, "--node-id", name,
                           "--heartbeat-interval", str(self.heartbeat_s), "--threads", "1", *args], env)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(timeout=10)

    def chat(self, model: str, messages: list[dict] | None = None, max_tokens: int = 16) -> httpx.Response:
        """A greedy chat completion through the tracker (default question: FRANCE)."""
        return httpx.post(f"{self.url}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": messages or FRANCE, "max_tokens": max_tokens, "temperature": 0})

    def get(self, path: str, **kw):
        resp = httpx.get(f"{self.url}{path}", timeout=30, **kw)
        resp.raise_for_status()
        return resp.json()

    def wait(self, check, timeout_s: float, what: str, interval_s: float = 0.25):
        """Poll ``check`` until truthy; bounded by ``timeout_s``. Returns the truthy value."""
        deadline = time.monotonic() + timeout_s
        last_exc = None
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"{name} exited with {p.returncode}:\n{self.tail(name)}")
            try:
                value = check()
                if value:
                    return value
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                last_exc = exc
            time.sleep(interval_s)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last error: {last_exc})\n"
                             + "\n".join(self.tail(n) for n in self.procs))

    def wait_routable(self, model: str, timeout_s: float = 120.0) -> dict:
        return self.wait(lambda: (c := self.get(f"/v1/coverage/{model}"))["routable"] and c, timeout_s,
                         f"{model} routable")

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return f"--- {name} ---\n" + "\n".join(text)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
