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

from meshnet.cli.options import DEFAULT_SHARDS, ServeOptions, takes
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


@takes(ServeOptions)
def serve(opts: ServeOptions) -> None:
    """Start a tracker serving the first layers and node processes serving the rest, the model split
    evenly into --nodes shards; Ctrl-C stops them all."""
    from meshnet.models.sources import cache_dir

    _check_port_free(opts.port)  # before anything is fetched, measured or written
    preset, ranges, choice = _prepare(opts)
    _stop_on_signals()
    logs = cache_dir() / "logs"
    # fresh tokens each run (ADR-0035): the nodes get the join token; the operator's is in a file
    operator_token = secrets.token_urlsafe(32)
    token_file = write_token(cache_dir() / f"serve-{opts.port}.operator-token", operator_token)
    mesh = LocalMesh(logs, port=opts.port, heartbeat_s=opts.heartbeat_interval, detach=True,
                     join_token=secrets.token_urlsafe(32), operator_token=operator_token,
                     state_dir=cache_dir() / "nodes")  # the nodes' own default: keys kept across runs
    url = mesh.url
    try:
        _start(mesh, opts, preset.name, ranges, choice)
        with console.status(f"loading {preset.name} across {len(ranges)} process(es)"):
            cov = mesh.wait_routable(preset.name, opts.timeout)
        console.print(f"[green]meshnet ready[/]: {preset.name} ({cov['num_layers']} layers) routable at {url}")
        console.print(f"  try: meshnet chat \"What is the capital of France?\" --url {url}")
        console.print("  OpenAI API: POST {}/v1/chat/completions · console: meshnet tui --url {}".format(url, url))
        console.print(f"  operator token in {token_file}: meshnet pin ... --token \"$(cat {token_file})\"",
                      soft_wrap=True, highlight=False)
        print(f"READY {url}", flush=True)
        if not opts.exit_when_ready:
            _watch(mesh, logs)
    except KeyboardInterrupt:
        console.print("stopping…")
    except MeshnetError as exc:
        for f in sorted(logs.glob("*.log")):
            err_console.print(f"--- {f.name} (tail) ---\n" + "\n".join(f.read_text().splitlines()[-8:]))
        mesh.stop(grace_s=opts.drain_grace + 5.0)
        fail(exc)
    finally:
        mesh.stop(grace_s=opts.drain_grace + 5.0)


#: a signal this soon after the first is the same stop delivered twice (a process-group kill that
#: also reaches a wrapper such as ``timeout``, which relays it), not a second Ctrl-C, seconds
DUPLICATE_SIGNAL_S = 1.0


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT stop the mesh (each child drains, ADR-0032); one arriving again after
    :data:`DUPLICATE_SIGNAL_S` kills what is left at once (:meth:`LocalMesh.stop`)."""
    first: list[float] = []

    def _stop(signum, frame):
        now = time.monotonic()
        if first and now - first[0] < DUPLICATE_SIGNAL_S:
            return  # the same stop, delivered twice: the drain goes on
        first[:1] = [now]
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def _check_port_free(port: int) -> None:
    """Exit with a clear error when ``port`` is taken on 127.0.0.1 (another ``meshnet serve``?),
    before any token file is written: a second serve must not answer READY for the first one's mesh."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: only a listener blocks
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            fail(MeshnetError(f"port {port} is in use ({exc.strerror}): is another meshnet serve running?",
                              hint=f"stop it, or pass --port with a free port (its URL is http://127.0.0.1:{port})"))


def _prepare(opts: ServeOptions):
    """Fetch the model once, split its layers into the shards the cores allow and choose the
    compute dtype and threads per process; returns ``(preset, ranges, choice)``. Exits on a bad
    model or split."""
    from meshnet.cli.services import chosen_device, compute_defaults
    from meshnet.models.sources import resolve
    from meshnet.node.calibration import max_processes, thread_budget, usable_cores
    from meshnet.presets import default_model, get_preset

    cores = usable_cores()
    shards = opts.nodes or max_processes(cores, DEFAULT_SHARDS)
    try:
        preset = get_preset(opts.model or default_model())
        with console.status(f"preparing {preset.name}") as status:
            resolve(preset.name, progress=lambda msg: status.update(f"{preset.name}: {msg}"))
        ranges = split_layers(preset.num_layers, shards)
    except (MeshnetError, ValueError) as exc:
        fail(exc if isinstance(exc, MeshnetError) else MeshnetError(str(exc)))
    if shards > cores:
        err_console.print(f"[yellow]--nodes {shards} on {cores} usable core(s): {shards} processes share them "
                          "(more threads than cores)[/]")
    opts.device = chosen_device(opts.device)  # every process gets the device itself, not "auto"
    choice = compute_defaults(preset.name, opts.dtype, opts.threads, thread_budget(cores, shards), opts.device)
    console.print(f"compute: {choice.compute_dtype} on {opts.device}, {choice.threads} thread(s) per process: "
                  f"{choice.reason}", highlight=False)
    if opts.threads is not None and shards <= cores < opts.threads * shards:
        err_console.print(f"[yellow]--threads {opts.threads} in {shards} processes: {opts.threads * shards} threads "
                          f"on {cores} usable core(s)[/]")
    return preset, ranges, choice


def _start(mesh: LocalMesh, opts: ServeOptions, model: str, ranges: list[LayerRange], choice) -> None:
    """Start the tracker (serving ``ranges[0]`` itself unless ``--no-tracker-layers``) and one node
    process per other range, each with its share of the machine's memory."""
    import psutil

    from meshnet.models.sources import cache_dir
    from meshnet.tracker.service import TrackerSettings as T

    from meshnet.models.devices import device_memory_bytes

    shards = len(ranges)
    # the processes share the machine's RAM, or the one GPU's free memory
    memory_mb = memory_per_node_mb(shards, device_memory_bytes(opts.device) or psutil.virtual_memory().total)
    drain = ["--drain-grace", str(opts.drain_grace), "--max-client-requests", str(opts.max_client_requests)]
    spot = ["--spot-check-rate", str(opts.spot_check_rate), "--audit-rate", str(opts.audit_rate),
            "--speculate", opts.speculate]
    compute = ["--dtype", choice.compute_dtype, "--device", opts.device, "--wire-dtype", opts.wire_dtype,
               "--memory", str(memory_mb)]
    own = (["--serve-layers", str(ranges[0]), "--threads", str(choice.threads), *compute, *spot]
           if opts.tracker_layers else [])
    mesh.start_tracker(model, node_timeout_s=T.node_timeout_s, rebalance_s=T.rebalance_interval_s,
                       db=cache_dir() / f"serve-tracker-{opts.port}.db", extra=[*drain, *own])
    first = 1 if opts.tracker_layers else 0
    for i, layers in enumerate(ranges[first:], start=first):
        start, end = layers.to_inclusive()
        mesh.start_node(f"node-{i}", "--model", model, "--shard-start", str(start), "--shard-end", str(end),
                        *compute, *drain, *spot, threads=choice.threads)
    who = (f"a tracker serving layers {ranges[0]} and {shards - 1} node(s)" if opts.tracker_layers
           else f"a tracker and {shards} node(s)")
    console.print(f"started {who}, {choice.threads} torch thread(s) and {memory_mb} MB each; logs in {mesh.log_dir}")


def _watch(mesh: LocalMesh, logs: Path) -> None:
    """Until Ctrl-C: report each node that exits (its layers become a coverage gap); exit with
    code 1 when the tracker does."""
    reported: set[str] = set()
    while True:
        for name, code in mesh.exited().items():
            if name == "tracker":
                err_console.print(f"[red]the tracker exited (code {code}); stopping[/]")
                raise typer.Exit(1)
            if name not in reported:  # the mesh goes on; the tracker shows the gap
                reported.add(name)
                err_console.print(f"[yellow]{name} exited (code {code}); its layers are a coverage gap until "
                                  f"another node serves them (log: {logs / f'{name}.log'})[/]")
        time.sleep(1.0)
