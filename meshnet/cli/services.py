"""``meshnet tracker start`` and ``meshnet node start``: run the services in this process."""

from __future__ import annotations


import typer

from meshnet.cli.options import MB, NodeOptions, TrackerOptions, takes
from meshnet.cli.output import err_console, fail, setup_logging
from meshnet.endpoints import check_endpoint
from meshnet.errors import MeshnetError

tracker_app = typer.Typer(help="Run the tracker (coverage map, placement, routing).", no_args_is_help=True)
node_app = typer.Typer(help="Run a node that serves layer shards.", no_args_is_help=True)

def compute_defaults(model: str | None, dtype: str, threads: int | None, budget: int, device: str = "cpu"):
    """The compute dtype and threads a node runs with: the flags where given, the rest measured on
    this host for ``model`` within ``budget`` threads (:func:`meshnet.node.calibration.calibrate`).
    Without a model there is nothing to measure: bfloat16 (ADR-0006) and ``budget`` threads. On a
    GPU (``device`` ``cuda:N``) nothing is timed on the CPU: the GPU's half dtype
    (:func:`meshnet.models.devices.gpu_dtype`) unless ``--dtype`` gives one.
    Exits with the error on a bad ``--dtype``."""
    from meshnet.node.calibration import Choice, calibrate

    from meshnet.models.devices import is_gpu

    gpu = is_gpu(device)
    if dtype not in ("auto", "float32", "bfloat16") and not (gpu and dtype == "float16"):
        fail(MeshnetError(f"--dtype must be auto, float32 or bfloat16{', float16' if gpu else ''}, got {dtype!r}",
                          hint="float16 is for GPUs (--device cuda)" if dtype == "float16" else None))
    given = None if dtype == "auto" else dtype
    if gpu:
        from meshnet.models.devices import gpu_dtype

        chosen = given or gpu_dtype(device)
        return Choice(chosen, threads or budget, f"on {device}: {chosen}{' as given' if given else ''}")
    if model is None:
        return Choice(given or "bfloat16", threads or budget, "no model to measure on: ADR-0006 defaults")
    with err_console.status(f"measuring decode speed of {model} on this host"):
        return calibrate(model, budget, dtype=given, threads=threads)


def auto_recipe(opts: NodeOptions, choice, device: str):
    """``--quantization auto``: the recipe measured fastest on this host within the doctor's
    tolerance (:func:`meshnet.node.recipe_choice.choose_recipe`, at ``choice``'s threads), set on
    ``opts``; returns ``choice`` with the recipe's compute dtype and reason. On a GPU nothing is
    measured: the GPU's half dtype, unquantized. Exits when there is no ``--model`` to measure
    (``--dtype`` given too is refused earlier, by :meth:`NodeOptions.check`)."""
    from meshnet.models.devices import is_gpu
    from meshnet.node.calibration import Choice

    if is_gpu(device):
        opts.quantization = "bfloat16"  # the recipe of an unquantized shard, in the GPU's own dtype
        return Choice(choice.compute_dtype, choice.threads, f"{choice.reason}; recipe auto on {device}: unquantized")
    if opts.model is None:
        fail(MeshnetError("--quantization auto measures the recipes on --model's layers: give --model"))
    from meshnet.node.recipe_choice import choose_recipe

    with err_console.status(f"measuring each recipe's decode speed of {opts.model} on this host"):
        picked = choose_recipe(opts.model)
    opts.quantization = picked.quantization
    return Choice(picked.compute_dtype, choice.threads, f"recipe {picked.reason}")


def chosen_device(spec: str) -> str:
    """The device ``--device spec`` names (:func:`meshnet.models.devices.resolve_device`); exits with
    one line naming the flag on a device this machine lacks."""
    from meshnet.models.devices import resolve_device

    try:
        return resolve_device(spec)
    except MeshnetError as exc:
        fail(exc)


def _serve(app, host: str, port: int) -> None:
    from meshnet.cli.server import serve

    serve(app, host, port, drain=getattr(app.state, "drain", None))  # SIGTERM drains first (ADR-0032)


@tracker_app.command("start")
@takes(TrackerOptions)
def tracker_start(opts: TrackerOptions) -> None:
    """Start a tracker that keeps the given models covered. Beyond loopback it needs --join-token
    and --operator-token (or --insecure). With --serve-layers it also serves those layers itself."""
    from meshnet.tracker.app import build_app
    from meshnet.tracker.service import TrackerService

    setup_logging(opts.log_level)
    _check_exposure(opts)
    names = _tracked_presets(opts.model, default=opts.serve_layers is not None)
    db = opts.db
    if db is None:
        from meshnet.models.sources import cache_dir

        cache_dir().mkdir(parents=True, exist_ok=True)
        db = str(cache_dir() / "tracker.db")
    settings = opts.settings(names, db)
    try:  # opens the database now: an unreachable one fails here, clearly
        service = TrackerService(settings, reference=_source_references(settings))
    except MeshnetError as exc:
        fail(exc)
    if opts.serve_layers is None:
        _serve(build_app(settings, service), opts.host, opts.port)
        return
    from meshnet import trackernode

    node = _tracker_node_settings(settings, names[0], opts)
    app = trackernode.build_app(settings, node, service=service)
    print(f"meshnet tracker at {trackernode.local_tracker_url(opts.host, opts.port)} serving {names[0]} layers "
          f"{opts.serve_layers} as node {node.node_id} at {node.endpoint}", flush=True)
    _serve(app, opts.host, opts.port)


def _source_references(settings):
    """The tracker's :class:`meshnet.tracker.admission.ReferenceSource` for ``settings.source_references``
    (ADR-0070): None when ``off``.

    Raises:
        typer.Exit: an unknown mode (a clear error first).
    """
    from meshnet.node.reference import MODES, SourceReferences

    if settings.source_references not in MODES:
        fail(MeshnetError(f"--source-references {settings.source_references!r}: expected one of {', '.join(MODES)}",
                          code="invalid_option"))
    if settings.source_references == "off":
        return None
    return SourceReferences(settings.models, settings.source_references)


def _check_exposure(opts: TrackerOptions) -> None:
    """Exit when a tracker would listen beyond loopback without its tokens (ADR-0035); warn loudly
    when ``--insecure`` allows it."""
    from meshnet.tracker.auth import exposure_problem, is_loopback

    problem = exposure_problem(opts.host, opts.join_token, opts.operator_token, opts.insecure)
    if problem:
        fail(MeshnetError(problem, code="insecure_tracker"))
    if opts.insecure and not is_loopback(opts.host) and not (opts.join_token and opts.operator_token):
        err_console.print(f"[bold red]INSECURE (--insecure): the tracker listens on {opts.host} without a join "
                          "token or an operator token: anyone who reaches it can join nodes or run operator "
                          "actions[/]", highlight=False)


def _tracked_presets(models: list[str], *, default: bool) -> tuple[str, ...]:
    """Preset names of ``--model`` flags (with ``default`` and none given: the default preset);
    exits on an unknown one."""
    from meshnet.presets import default_model, get_preset

    try:
        names = tuple(get_preset(m).name for m in models)
        return names or ((get_preset(default_model()).name,) if default else ())
    except MeshnetError as exc:
        fail(exc)


def _refuse_a_running_identity(node_id: str, state_dir) -> None:
    """Fail at once, as one line, when a node with this id already runs from its state directory on
    this host (the node's agent takes the lock for good once the server starts, ADR-0056)."""
    import os

    from meshnet.node import identity

    try:
        os.close(identity.lock_state_dir(state_dir or identity.default_state_dir(node_id), node_id))
    except MeshnetError as exc:
        fail(exc)


def _tracker_node_settings(tracker, model: str, opts: TrackerOptions):
    """The settings of the node a tracker runs for ``--serve-layers`` (ADR-0044); exits on a bad
    range or URL. Sets torch's thread count to the one chosen."""
    from meshnet.node.calibration import usable_cores
    from meshnet.layers import LayerRange
    from meshnet.node.settings import NodeSettings
    from meshnet.presets import get_preset
    from meshnet.trackernode import local_tracker_url, node_endpoint

    try:
        layers = LayerRange.parse(opts.serve_layers)
    except ValueError as exc:
        fail(MeshnetError(f"--serve-layers: {exc}", hint="an inclusive range like 0-9"))
    num_layers = get_preset(model).num_layers
    if layers.end > num_layers:
        fail(MeshnetError(f"--serve-layers {opts.serve_layers} is beyond {model}'s {num_layers} layers "
                          f"(the last is {num_layers - 1})"))
    try:
        public_url = None if opts.public_url is None else check_endpoint(opts.public_url)
    except MeshnetError as exc:
        fail(exc)
    if opts.wire_dtype not in ("float32", "bfloat16"):
        fail(MeshnetError(f"--wire-dtype must be float32 or bfloat16, got {opts.wire_dtype!r}"))
    device = chosen_device(opts.device)
    choice = compute_defaults(model, opts.dtype, opts.threads, usable_cores(), device)
    err_console.print(f"compute: {choice.compute_dtype} on {device}, {choice.threads} thread(s): {choice.reason}",
                      highlight=False)
    import torch

    torch.set_num_threads(choice.threads)
    own_url = local_tracker_url(tracker.host, tracker.port)
    _refuse_a_running_identity(opts.node_id, opts.state_dir)
    return NodeSettings(host=tracker.host, port=tracker.port, public_url=node_endpoint(public_url or own_url),
                        node_id=opts.node_id, tracker_url=own_url, join_token=tracker.join_token, state_dir=opts.state_dir,
                        model=model, shard=layers, memory_bytes=None if opts.memory is None else opts.memory * MB,
                        compute_dtype=choice.compute_dtype, device=device, wire_dtype=opts.wire_dtype,
                        heartbeat_interval_s=tracker.heartbeat_interval_s, torch_threads=choice.threads,
                        drain_grace_s=tracker.drain_grace_s, spot_check_rate=opts.spot_check_rate,
                        audit_rate=opts.audit_rate, speculate=opts.speculate)


@node_app.command("start")
@takes(NodeOptions)
def node_start(opts: NodeOptions) -> None:
    """Start a node. With --model and --shard-start/--shard-end it serves that shard (pinned); with
    --model alone it asks the tracker which range to take; with neither it waits for directives.
    A node the tracker cannot reach serves through a relay (ADR-0045)."""
    from meshnet.node.calibration import usable_cores

    setup_logging(opts.log_level)
    opts.check()
    if not opts.tracker:
        err_console.print("no --tracker: this node serves on its own and joins no mesh (nothing routes to it)",
                          highlight=False)
    device = chosen_device(opts.device)
    choice = compute_defaults(opts.model, opts.dtype, opts.threads, usable_cores(), device)
    import torch

    torch.set_num_threads(choice.threads)
    if opts.quantization == "auto":
        choice = auto_recipe(opts, choice, device)
    print(f"compute: {choice.compute_dtype} on {device}, {choice.threads} thread(s): {choice.reason}", flush=True)
    settings = opts.settings(choice.compute_dtype, choice.threads, device)
    if settings.tracker_url:  # a node that joins a mesh signs as its identity: one process per identity
        _refuse_a_running_identity(settings.node_id, settings.state_dir)
    from meshnet.node.app import build_app

    app = build_app(settings)
    print(f"meshnet node {settings.node_id} listening on {settings.endpoint}", flush=True)
    _serve(app, opts.host, opts.port)
