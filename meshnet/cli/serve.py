"""``meshnet serve``: a whole local mesh in one command.

Pulls the model (once), splits its layers evenly into ``--nodes`` shards, and starts a tracker
that serves the first shard itself (ADR-0044: it answers chat as the entry, no proxy hop) plus
one node process per other shard; ``--no-tracker-layers`` gives the tracker no layers and starts
a node for every shard. It waits until the model is routable, prints the URL, and stops every
child on Ctrl-C or SIGTERM. Each child drains (ADR-0032): chats in flight finish within
``--drain-grace`` seconds, new ones are refused, nodes deregister; a second Ctrl-C kills what
is left at once.

Compute defaults are measured on the host (:mod:`meshnet.node.calibration`): the usable cores
are split between the processes that serve layers, so their torch threads never add up to more
than the cores (the default ``--nodes`` is 3, or fewer when fewer cores are usable), and the
dtype and thread count within that budget are the fastest measured. ``--dtype`` and
``--threads`` given win over the measurement.
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


#: shards ``meshnet serve`` splits the model into when the cores allow
DEFAULT_SHARDS = 3


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
          nodes: int = typer.Option(None, "--nodes", "-n", min=1,
                                    help=f"Shards the layers are split into, one process each, the tracker "
                                         f"serving the first (default: {DEFAULT_SHARDS}, or the usable cores "
                                         f"when fewer, so no core runs two processes' threads)."),
          tracker_layers: bool = typer.Option(True, "--tracker-layers/--no-tracker-layers",
                                              help="The tracker serves the first shard and answers chat as its "
                                                   "entry (ADR-0044); without, a node process serves every shard."),
          port: int = typer.Option(8700, "--port", help="Tracker port (the URL clients use)."),
          dtype: str = typer.Option("auto", "--dtype",
                                    help="Compute dtype: auto (measured on this host), bfloat16 or float32 (exact)."),
          wire_dtype: str = typer.Option("bfloat16", "--wire-dtype", help="Activation dtype between nodes."),
          timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the model to be routable."),
          threads: int = typer.Option(None, "--threads", min=1,
                                      help="torch threads per process (default: measured on this host within the "
                                           "usable cores split evenly between the processes)."),
          heartbeat_interval: float = typer.Option(10.0, "--heartbeat-interval", help="Seconds between heartbeats."),
          drain_grace: float = typer.Option(30.0, "--drain-grace", min=0.0,
                                            help="On stop, seconds chats in flight get to finish."),
          spot_check_rate: float = typer.Option(0.02, "--spot-check-rate", min=0.0, max=1.0,
                                                help="Share of sessions whose hops the entry also runs on a second "
                                                     "holder and compares (ADR-0042; 0 disables)."),
          exit_when_ready: bool = typer.Option(False, "--exit-when-ready", help="Stop everything once ready (smoke test).")) -> None:
    """Start a tracker serving the first layers and node processes serving the rest, the model split
    evenly into --nodes shards; Ctrl-C stops them all."""
    from meshnet.cli.services import compute_defaults
    from meshnet.models.sources import cache_dir, resolve
    from meshnet.node.calibration import max_processes, thread_budget, usable_cores
    from meshnet.presets import default_model, get_preset

    cores = usable_cores()
    shards = nodes or max_processes(cores, DEFAULT_SHARDS)
    try:
        preset = get_preset(model or default_model())
        with console.status(f"preparing {preset.name}") as status:
            resolve(preset.name, progress=lambda msg: status.update(f"{preset.name}: {msg}"))
        ranges = split_layers(preset.num_layers, shards)
    except (MeshnetError, ValueError) as exc:
        fail(exc if isinstance(exc, MeshnetError) else MeshnetError(str(exc)))
    if shards > cores:
        err_console.print(f"[yellow]--nodes {shards} on {cores} usable core(s): {shards} processes share them "
                          "(more threads than cores)[/]")
    choice = compute_defaults(preset.name, dtype, threads, thread_budget(cores, shards))
    console.print(f"compute: {choice.compute_dtype}, {choice.threads} thread(s) per process: {choice.reason}",
                  highlight=False)
    if threads is not None and shards <= cores < threads * shards:
        err_console.print(f"[yellow]--threads {threads} in {shards} processes: {threads * shards} threads on "
                          f"{cores} usable core(s)[/]")

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    logs = cache_dir() / "logs"
    import psutil

    memory_mb = memory_per_node_mb(shards, psutil.virtual_memory().total)
    # fresh tokens each run (ADR-0035): the nodes get the join token; the operator's is in a file
    operator_token = secrets.token_urlsafe(32)
    token_file = write_token(cache_dir() / f"serve-{port}.operator-token", operator_token)
    mesh = LocalMesh(logs, port=port, heartbeat_s=heartbeat_interval, detach=True,
                     join_token=secrets.token_urlsafe(32), operator_token=operator_token)
    url = mesh.url
    drain = ["--drain-grace", str(drain_grace)]
    spot = ["--spot-check-rate", str(spot_check_rate)]
    compute = ["--dtype", choice.compute_dtype, "--wire-dtype", wire_dtype, "--memory", str(memory_mb)]
    try:
        own = ["--serve-layers", str(ranges[0]), "--threads", str(choice.threads), *compute, *spot] if tracker_layers else []
        mesh.start_tracker(preset.name, node_timeout_s=25.0, rebalance_s=30.0,
                           db=cache_dir() / f"serve-tracker-{port}.db", extra=[*drain, *own])
        for i, layers in enumerate(ranges[1:] if tracker_layers else ranges, start=1 if tracker_layers else 0):
            start, end = layers.to_inclusive()
            mesh.start_node(f"node-{i}", "--model", preset.name, "--shard-start", str(start), "--shard-end", str(end),
                            *compute, *drain, *spot, threads=choice.threads)
        who = (f"a tracker serving layers {ranges[0]} and {shards - 1} node(s)" if tracker_layers
               else f"a tracker and {shards} node(s)")
        console.print(f"started {who}, {choice.threads} torch thread(s) and {memory_mb} MB each; logs in {logs}")
        with console.status(f"loading {preset.name} across {shards} process(es)"):
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
