"""``meshnet serve``: a whole local mesh in one command.

Pulls the model (once), starts a tracker and ``--nodes`` node processes that split the
model's layers evenly, waits until the model is routable, prints the URL, and stops every
child on Ctrl-C or SIGTERM. Each child drains (ADR-0032): chats in flight finish within
``--drain-grace`` seconds, new ones are refused, nodes deregister; a second Ctrl-C kills what
is left at once.
A node that dies leaves a coverage gap and the rest keeps running; the tracker dying stops
everything. Child logs go to ``<cache>/logs/``.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import typer

from meshnet.cli.output import console, err_console, fail
from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange
from meshnet.localmesh import LocalMesh


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


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_node(nodes: int, cores: int) -> int:
    """torch intra-op threads for each of ``nodes`` local node processes sharing ``cores``.

    The cores are split evenly (``cores // nodes``, at least 1), so the nodes together never
    ask for more threads than there are cores; with more nodes than cores each gets one.
    torch's default (one thread per core in every process) would run ``nodes × cores``
    threads on ``cores`` cores.
    """
    return max(1, cores // max(1, nodes))


def memory_per_node_mb(nodes: int, total_bytes: int) -> int:
    """The ``--memory`` (MB) of each of ``nodes`` local nodes sharing ``total_bytes`` of RAM.

    Each node would otherwise report the whole machine's memory, and the tracker would budget
    ``nodes`` times the RAM there is (ADR-0003 budgets 80 % of what a node reports).
    """
    return max(1, total_bytes // max(1, nodes) // (1024 * 1024))


def write_token(path: Path, token: str) -> Path:
    """Write ``token`` to ``path`` readable by its owner only (mode 0600); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return path


def serve(model: str = typer.Option(None, "--model", "-m", help="Preset to serve (default: the default preset)."),
          nodes: int = typer.Option(3, "--nodes", "-n", min=1, help="Local node processes splitting the layers."),
          port: int = typer.Option(8700, "--port", help="Tracker port (the URL clients use)."),
          dtype: str = typer.Option("bfloat16", "--dtype",
                                    help="Node compute dtype: bfloat16 (faster) or float32 (exact)."),
          wire_dtype: str = typer.Option("bfloat16", "--wire-dtype", help="Activation dtype between nodes."),
          timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the model to be routable."),
          threads: int = typer.Option(None, "--threads", min=1,
                                     help="torch threads per node (default: the usable cores split evenly between the nodes)."),
          heartbeat_interval: float = typer.Option(10.0, "--heartbeat-interval", help="Seconds between heartbeats."),
          drain_grace: float = typer.Option(30.0, "--drain-grace", min=0.0,
                                            help="On stop, seconds chats in flight get to finish."),
          spot_check_rate: float = typer.Option(0.02, "--spot-check-rate", min=0.0, max=1.0,
                                                help="Share of sessions whose hops the entry also runs on a second "
                                                     "holder and compares (ADR-0042; 0 disables)."),
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
    threads = threads or threads_per_node(nodes, usable_cores())
    import psutil

    memory_mb = memory_per_node_mb(nodes, psutil.virtual_memory().total)
    # fresh tokens each run (ADR-0035): the nodes get the join token; the operator's is in a file
    operator_token = secrets.token_urlsafe(32)
    token_file = write_token(cache_dir() / f"serve-{port}.operator-token", operator_token)
    mesh = LocalMesh(logs, port=port, heartbeat_s=heartbeat_interval, detach=True,
                     join_token=secrets.token_urlsafe(32), operator_token=operator_token)
    url = mesh.url
    try:
        mesh.start_tracker(preset.name, node_timeout_s=25.0, rebalance_s=30.0,
                           db=cache_dir() / f"serve-tracker-{port}.db", extra=["--drain-grace", str(drain_grace)])
        for i, layers in enumerate(ranges):
            start, end = layers.to_inclusive()
            mesh.start_node(f"node-{i}", "--model", preset.name, "--shard-start", str(start), "--shard-end", str(end),
                            "--dtype", dtype, "--wire-dtype", wire_dtype, "--drain-grace", str(drain_grace),
                            "--memory", str(memory_mb), "--spot-check-rate", str(spot_check_rate), threads=threads)
        console.print(f"started tracker and {nodes} node(s), {threads} torch thread(s) and {memory_mb} MB each; "
                      f"logs in {logs}")
        with console.status(f"loading {preset.name} across {nodes} node(s)"):
            cov = mesh.wait_routable(preset.name, timeout)
        console.print(f"[green]meshnet ready[/]: {preset.name} ({cov['num_layers']} layers) routable at {url}")
        console.print(f"  try: meshnet chat \"What is the capital of France?\" --url {url}")
        console.print("  OpenAI API: POST {}/v1/chat/completions · console: meshnet tui --url {}".format(url, url))
        console.print(f"  operator token in {token_file}: meshnet pin ... --token \"$(cat {token_file})\"",
                      soft_wrap=True, highlight=False)
        print(f"READY {url}", flush=True)
        reported: set[str] = set()
        while not exit_when_ready:
            for name, code in mesh.exited().items():
                if name == "tracker":
                    err_console.print(f"[red]the tracker exited (code {code}); stopping[/]")
                    raise typer.Exit(1)
                if name not in reported:  # the mesh goes on; the tracker shows the gap
                    reported.add(name)
                    err_console.print(f"[yellow]{name} exited (code {code}); its layers are a coverage gap until "
                                      f"another node serves them (log: {logs / f'{name}.log'})[/]")
            time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("stopping…")
    except MeshnetError as exc:
        for f in sorted(logs.glob("*.log")):
            err_console.print(f"--- {f.name} (tail) ---\n" + "\n".join(f.read_text().splitlines()[-8:]))
        mesh.stop(grace_s=drain_grace + 5.0)
        fail(exc)
    finally:
        mesh.stop(grace_s=drain_grace + 5.0)
