"""``meshnet serve``: a whole local mesh in one command.

Pulls the model (once), starts a tracker and ``--nodes`` node processes that split the
model's layers evenly, waits until the model is routable, prints the URL, and stops every
child on Ctrl-C or SIGTERM. A node that dies leaves a coverage gap and the rest keeps
running; the tracker dying stops everything. Child logs go to ``<cache>/logs/``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import typer

from meshnet.cli.output import console, err_console, fail
from meshnet.endpoints import base_url
from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange


def split_layers(num_layers: int, parts: int) -> list[LayerRange]:
    """Split ``[0, num_layers)`` into ``parts`` contiguous ranges, sizes differing by at most 1.

    Raises:
        ValueError: ``parts`` < 1 or more parts than layers.
    """
    if not 1 <= parts <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} shards")
    base, extra = divmod(num_layers, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        ranges.append(LayerRange(start, start + size))
        start += size
    return ranges


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_all(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every child (by PID), then SIGKILL those still alive after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_routable(url: str, model: str, procs: list[subprocess.Popen], timeout_s: float) -> dict:
    """Poll the tracker until ``model`` is routable (bounded by ``timeout_s``).

    Raises:
        MeshnetError: a child exited, or the timeout passed.
    """
    deadline = time.monotonic() + timeout_s
    last = {}
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise MeshnetError(f"a meshnet process exited early (code {dead[0].returncode})",
                               hint="see the logs printed above")
        try:
            last = httpx.get(f"{url}/v1/coverage/{model}", timeout=2.0).json()
            if last.get("routable"):
                return last
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise MeshnetError(f"{model} not routable after {timeout_s:.0f} s (coverage: {last})")


def serve(model: str = typer.Option(None, "--model", "-m", help="Preset to serve (default: the default preset)."),
          nodes: int = typer.Option(3, "--nodes", "-n", min=1, help="Local node processes splitting the layers."),
          port: int = typer.Option(8700, "--port", help="Tracker port (the URL clients use)."),
          dtype: str = typer.Option("bfloat16", "--dtype",
                                    help="Node compute dtype: bfloat16 (faster) or float32 (exact)."),
          wire_dtype: str = typer.Option("bfloat16", "--wire-dtype", help="Activation dtype between nodes."),
          timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the model to be routable."),
          threads: int = typer.Option(None, "--threads", help="torch threads per node (default: all cores)."),
          heartbeat_interval: float = typer.Option(10.0, "--heartbeat-interval", help="Seconds between heartbeats."),
          exit_when_ready: bool = typer.Option(False, "--exit-when-ready", help="Stop everything once ready (smoke test).")) -> None:
    """Start a tracker and N local nodes that split the model evenly; Ctrl-C stops them all."""
    from meshnet.models.sources import cache_dir, resolve
    from meshnet.presets import default_model, get_preset

    try:
        preset = get_preset(model or default_model())
        with console.status(f"preparing {preset.name}") as status:
            resolve(preset.name, progress=lambda msg: status.update(f"{preset.name}: {msg}"))
        ranges = split_layers(preset.num_layers, nodes)
    except (MeshnetError, ValueError) as exc:
        fail(exc if isinstance(exc, MeshnetError) else MeshnetError(str(exc)))
    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    logs = cache_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    url = base_url("127.0.0.1", port)
    procs: list[subprocess.Popen] = []
    common = ["--heartbeat-interval", str(heartbeat_interval)]
    try:
        procs.append(_spawn(["tracker", "start", "--model", preset.name, "--port", str(port),
                             "--db", str(cache_dir() / f"serve-tracker-{port}.db"), *common], logs / "tracker.log"))
        for i, layers in enumerate(ranges):
            start, end = layers.to_inclusive()
            args = ["node", "start", "--tracker", url, "--model", preset.name, "--shard-start", str(start),
                    "--shard-end", str(end), "--dtype", dtype, "--wire-dtype", wire_dtype, "--node-id",
                    f"node-{i}", *common] + (["--threads", str(threads)] if threads else [])
            procs.append(_spawn(args, logs / f"node-{i}.log"))
        console.print(f"started tracker and {nodes} node(s); logs in {logs}")
        with console.status(f"loading {preset.name} across {nodes} node(s)"):
            cov = wait_routable(url, preset.name, procs, timeout)
        console.print(f"[green]meshnet ready[/]: {preset.name} ({cov['num_layers']} layers) routable at {url}")
        console.print(f"  try: meshnet chat \"What is the capital of France?\" --url {url}")
        console.print("  OpenAI API: POST {}/v1/chat/completions · console: meshnet tui --url {}".format(url, url))
        print(f"READY {url}", flush=True)
        reported: set[int] = set()
        while not exit_when_ready:
            if procs[0].poll() is not None:
                err_console.print(f"[red]the tracker exited (code {procs[0].returncode}); stopping[/]")
                raise typer.Exit(1)
            for i, p in enumerate(procs[1:]):
                if p.poll() is not None and i not in reported:  # the mesh goes on; the tracker shows the gap
                    reported.add(i)
                    err_console.print(f"[yellow]node-{i} exited (code {p.returncode}); its layers are a "
                                      f"coverage gap until another node serves them (log: {logs / f'node-{i}.log'})[/]")
            time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("stopping…")
    except MeshnetError as exc:
        for f in sorted(logs.glob("*.log")):
            err_console.print(f"--- {f.name} (tail) ---\n" + "\n".join(f.read_text().splitlines()[-8:]))
        stop_all(procs)
        fail(exc)
    finally:
        stop_all(procs)
