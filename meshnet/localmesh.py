"""A whole mesh on this machine: a tracker (or several on one database) and node processes on 127.0.0.1.

The one launcher behind ``meshnet serve``, the integration tests and ``bench/``. Every
process is a real ``python -m meshnet.cli.main`` child; every child started here is stopped
by its PID in :meth:`LocalMesh.stop` (SIGTERM, then SIGKILL after a grace period). Waits are
bounded in time and fail fast when a child exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx

from meshnet.endpoints import base_url, free_port
from meshnet.errors import MeshnetError

T = TypeVar("T")


class LocalMesh:
    """A tracker plus nodes, each a real meshnet process, with their logs in ``log_dir``.

    Args:
        log_dir: one ``<name>.log`` per process (stdout and stderr).
        port: tracker port (default: a free one).
        heartbeat_s: heartbeat interval given to the tracker and every node, seconds.
        detach: start children in their own session, so a terminal's Ctrl-C reaches only the
            launcher, which then stops them in order (``meshnet serve``).
        env: extra environment for every child.
        join_token, operator_token: the tracker's tokens (ADR-0035), handed to it and (the join
            token) to every node through the environment, never on a command line; None: none.
        state_dir: each node (and a tracker serving layers) keeps its key in ``state_dir/<name>``
            (None: ``log_dir/state``, so two meshes on one host never share a node identity: a
            node's state directory is locked while it runs, ADR-0056). ``meshnet serve`` passes
            ``<cache>/nodes``, the nodes' own default.
    """

    def __init__(self, log_dir: Path, *, port: int | None = None, heartbeat_s: float = 0.5,
                 detach: bool = False, env: dict[str, str] | None = None, join_token: str | None = None,
                 operator_token: str | None = None, state_dir: Path | None = None) -> None:
        self.join_token, self.operator_token = join_token, operator_token
        self.log_dir = Path(log_dir)
        self.state_dir = Path(state_dir) if state_dir is not None else self.log_dir / "state"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.heartbeat_s = heartbeat_s
        self.detach = detach
        self.env = dict(env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self.taken: list[subprocess.Popen] = []  # children out of watch (see :meth:`take`), still stopped
        self.port = port or free_port()
        self.url = base_url("127.0.0.1", self.port)
        #: every tracker started: child name -> URL (nodes are given them all, in this order)
        self.trackers: dict[str, str] = {}

    # ---- processes --------------------------------------------------------------------

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
              prefix: list[str] | None = None, module: str = "meshnet.cli.main") -> subprocess.Popen:
        """Start ``meshnet <args>`` as child ``name`` (its output goes to ``<log_dir>/<name>.log``).
        ``prefix`` runs it under a command that execs it in place, keeping the PID (e.g.
        ``["ip", "netns", "exec", "ns1"]`` to start it in a network namespace); ``module`` is the
        Python module run as ``meshnet`` (a test may pass its own wrapper of the CLI)."""
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", module, *args], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=self.detach,
                                    env={**os.environ, "MESHNET_LOG_LEVEL": "INFO", **self.env, **(env or {})})
        self.procs[name] = proc
        return proc

    def start_tracker(self, *models: str, node_timeout_s: float = 3.0, rebalance_s: float = 2.0,
                      db: Path | str | None = None, extra: list[str] | None = None, wait_s: float = 30.0,
                      name: str = "tracker") -> str:
        """Start a tracker keeping ``models`` covered and wait until it answers (``wait_s``); returns
        its URL. The first one listens on :attr:`port`; another (a second ``name``, sharing a
        PostgreSQL ``db``, ADR-0043) on a free port of 127.0.0.1; the first answers at :attr:`url`; a
        restart of one (its ``name`` again) at its earlier URL. Nodes started afterwards are given every
        tracker's URL.

        Raises:
            MeshnetError: it exited or did not answer within ``wait_s``.
        """
        if name in self.trackers:  # a restart: the same URL
            url = self.trackers[name]
            port = httpx.URL(url).port
        elif not self.trackers:
            port, url = self.port, self.url
        else:
            port = free_port()
            url = base_url("127.0.0.1", port)
        self.trackers[name] = url
        args = ["tracker", "start", "--port", str(port), "--db", str(db or self.log_dir / f"{name}.db"),
                "--heartbeat-interval", str(self.heartbeat_s), "--node-timeout", str(node_timeout_s),
                "--rebalance-interval", str(rebalance_s)]
        for m in models:
            args += ["--model", m]
        if "--serve-layers" in (extra or []):  # its node keeps its key with this mesh's other nodes
            args += ["--state-dir", str(self.state_dir / name)]
        tokens = {"MESHNET_JOIN_TOKEN": self.join_token, "MESHNET_OPERATOR_TOKEN": self.operator_token}
        self.spawn(name, args + (extra or []), {k: v for k, v in tokens.items() if v})
        self.wait(lambda: httpx.get(f"{url}/v1/health", timeout=1).status_code == 200, wait_s, f"{name} up")
        return url

    def start_node(self, name: str, *args: str, threads: int = 1, env: dict[str, str] | None = None,
                   prefix: list[str] | None = None, module: str = "meshnet.cli.main") -> None:
        """Start node ``name`` (its ``--node-id``) joining this mesh's trackers (all of them, the
        first one first); ``args`` as for ``meshnet node start`` (for example ``--model M
        --shard-start 0 --shard-end 9``); ``prefix`` and ``module`` as for :meth:`spawn`."""
        state = ["--state-dir", str(self.state_dir / name)]
        token = {"MESHNET_JOIN_TOKEN": self.join_token} if self.join_token else {}
        trackers = [arg for url in (self.trackers.values() or [self.url]) for arg in ("--tracker", url)]
        self.spawn(name, ["node", "start", *trackers, "--node-id", name, *state,
                          "--heartbeat-interval", str(self.heartbeat_s), "--threads", str(threads), *args],
                   {**token, **(env or {})}, prefix, module)

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> int:
        """Send ``sig`` to child ``name``, wait for it to exit and forget it; returns its exit code."""
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        return proc.wait(timeout=timeout_s)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to child ``name`` by its PID without waiting (``SIGSTOP`` freezes it,
        ``SIGCONT`` resumes it); it stays a child, stopped by :meth:`kill` or :meth:`stop`."""
        self.procs[name].send_signal(sig)

    def take(self, name: str) -> subprocess.Popen:
        """Take child ``name`` out of the watched set (its exit is expected, e.g. after a SIGTERM the
        caller sends): :meth:`wait` no longer fails on it, and :meth:`stop` still stops it by PID."""
        proc = self.procs.pop(name)
        self.taken.append(proc)
        return proc

    def exited(self) -> dict[str, int]:
        """Children that have exited: name → exit code."""
        return {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every child by its PID: SIGTERM the nodes and wait for them (each drains, tells the
        tracker and deregisters, ADR-0032), then SIGTERM the tracker and wait for it; each wait is
        bounded by ``grace_s``, then what is left is SIGKILLed. A KeyboardInterrupt while waiting
        (a second Ctrl-C) SIGKILLs every child left at once."""
        nodes = [p for name, p in self.procs.items() if name not in self.trackers] + self.taken
        tracker = [p for name, p in self.procs.items() if name in self.trackers]
        try:
            for group in (nodes, tracker):  # the tracker last: draining nodes still reach it
                for proc in group:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                        proc.send_signal(signal.SIGCONT)  # a stopped child (SIGSTOP) drains too
                deadline = time.monotonic() + grace_s
                for proc in group:
                    try:
                        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        except KeyboardInterrupt:
            for proc in nodes + tracker:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            raise
        finally:
            self.procs.clear()
            self.taken.clear()

    def __enter__(self) -> "LocalMesh":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- waiting and reading ----------------------------------------------------------

    def get(self, path: str, **kw) -> dict:
        """``GET`` a tracker path; the JSON body.

        Raises:
            httpx.HTTPStatusError: a non-2xx answer.
        """
        resp = httpx.get(f"{self.url}{path}", timeout=30, **kw)
        resp.raise_for_status()
        return resp.json()

    def wait(self, check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.25) -> T:
        """Poll ``check`` until it returns something truthy (returned), for at most ``timeout_s``.

        HTTP errors and missing keys inside ``check`` count as "not yet".

        Raises:
            MeshnetError: a child exited (``process_exited``, with its log tail) or the time ran
                out (``mesh_timeout``, with every log's tail).
        """
        deadline = time.monotonic() + timeout_s
        last_exc = None
        while time.monotonic() < deadline:
            for name, code in self.exited().items():
                raise MeshnetError(f"{name} exited with {code} while waiting for {what}:\n{self.tail(name)}",
                                   code="process_exited")
            try:
                value = check()
                if value:
                    return value
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                last_exc = exc
            time.sleep(interval_s)
        raise MeshnetError(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last_exc})\n"
                           + "\n".join(self.tail(n) for n in self.procs), code="mesh_timeout")

    def wait_routable(self, model: str, timeout_s: float = 120.0) -> dict:
        """Wait until ``model`` is routable; returns its coverage map (see :meth:`wait`)."""
        return self.wait(lambda: (c := self.get(f"/v1/coverage/{model}"))["routable"] and c, timeout_s,
                         f"{model} routable", interval_s=0.5)

    def tail(self, name: str, lines: int = 15) -> str:
        """The last ``lines`` lines of child ``name``'s log, headed by its name."""
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return f"--- {name} ---\n" + "\n".join(text)
