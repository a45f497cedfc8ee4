"""``meshnet tracker start`` and ``meshnet node start``: run the services in this process."""

from __future__ import annotations

from pathlib import Path

import typer

from meshnet.cli.output import err_console, fail, setup_logging
from meshnet.endpoints import check_endpoint, check_endpoints, free_port
from meshnet.errors import MeshnetError
from meshnet.node.settings import NodeSettings as N
from meshnet.tracker.service import TrackerSettings as T

tracker_app = typer.Typer(help="Run the tracker (coverage map, placement, routing).", no_args_is_help=True)
node_app = typer.Typer(help="Run a node that serves layer shards.", no_args_is_help=True)

LogOpt = typer.Option(None, "--log-level", help="DEBUG, INFO, WARNING (env MESHNET_LOG_LEVEL).")
DrainOpt = typer.Option(N.drain_grace_s, "--drain-grace", min=0.0, envvar="MESHNET_DRAIN_GRACE",
                        help="On SIGTERM, seconds in-flight generations may take to finish before they are cut.")
MaxBodyOpt = typer.Option(None, "--max-body-bytes", envvar="MESHNET_MAX_BODY_BYTES", min=1024,
                          help="Largest JSON request body, bytes; bigger ones get 413 (default 8 MiB).")


def _body_limit(max_body_bytes: int | None) -> dict:
    """Settings keyword for ``--max-body-bytes`` (none: the settings' default)."""
    return {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}


DtypeOpt = typer.Option("auto", "--dtype",
                        help="Compute dtype: auto (measured on this host: bfloat16 when clearly faster, else the "
                             "exact float32), float32 or bfloat16.")
ThreadsOpt = typer.Option(None, "--threads", min=1,
                          help="torch intra-op threads (default: measured on this host, at most the usable cores).")


def compute_defaults(model: str | None, dtype: str, threads: int | None, budget: int):
    """The compute dtype and threads a node runs with: the flags where given, the rest measured on
    this host for ``model`` within ``budget`` threads (:func:`meshnet.node.calibration.calibrate`).
    Without a model there is nothing to measure: bfloat16 (ADR-0006) and ``budget`` threads.
    Exits with the error on a bad ``--dtype``."""
    from meshnet.node.calibration import Choice, calibrate

    if dtype not in ("auto", "float32", "bfloat16"):
        fail(MeshnetError(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}"))
    given = None if dtype == "auto" else dtype
    if model is None:
        return Choice(given or "bfloat16", threads or budget, "no model to measure on: ADR-0006 defaults")
    with err_console.status(f"measuring decode speed of {model} on this host"):
        return calibrate(model, budget, dtype=given, threads=threads)


def _serve(app, host: str, port: int) -> None:
    from meshnet.cli.server import serve

    serve(app, host, port, drain=getattr(app.state, "drain", None))  # SIGTERM drains first (ADR-0032)


@tracker_app.command("start")
def tracker_start(
        model: list[str] = typer.Option([], "--model", "-m", help="Preset to keep covered (repeatable)."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
        port: int = typer.Option(T.port, "--port", help="Port to listen on."),
        db: str = typer.Option(None, "--db", envvar="MESHNET_TRACKER_DB",
                               help="sqlite file for the tracker's state (default: ~/.cache/meshnet/tracker.db), "
                                    "or postgresql://user@host:5432/db: several trackers may share that database, "
                                    "one leading, the others standing by."),
        heartbeat_interval: float = typer.Option(T.heartbeat_interval_s, "--heartbeat-interval", min=0.1, help="Node heartbeat, s."),
        node_timeout: float = typer.Option(T.node_timeout_s, "--node-timeout", min=0.5, help="Dropout after this many s."),
        rebalance_interval: float = typer.Option(T.rebalance_interval_s, "--rebalance-interval", min=0.5, help="Rebalance period, s."),
        join_settle: float = typer.Option(T.join_settle_s, "--join-settle", min=0.0,
                                          help="Seconds to wait for more joins before placing, s."),
        operator_token: str = typer.Option(None, "--operator-token", envvar="MESHNET_OPERATOR_TOKEN",
                                           help="Bearer token required for operator actions (required beyond "
                                                "loopback)."),
        join_token: str = typer.Option(None, "--join-token", envvar="MESHNET_JOIN_TOKEN",
                                       help="Token a node must present to register (required beyond loopback)."),
        insecure: bool = typer.Option(False, "--insecure",
                                      help="Listen beyond loopback without join/operator tokens, on purpose."),
        max_body_bytes: int = MaxBodyOpt,
        probe_timeout: float = typer.Option(T.probe_timeout_s, "--probe-timeout", min=0.1, envvar="MESHNET_PROBE_TIMEOUT",
                                            help="Seconds a node's endpoint has to answer the tracker's "
                                                 "reachability probe; unreachable nodes are not admitted."),
        drain_grace: float = DrainOpt,
        directive_retention: float = typer.Option(T.directive_retention_s, "--directive-retention", min=0.0,
                                                  envvar="MESHNET_DIRECTIVE_RETENTION",
                                                  help="Seconds finished (done/failed) directives are kept."),
        serve_layers: str = typer.Option(None, "--serve-layers",
                                         help="Also serve these layers (inclusive 'A-B', e.g. 0-9) of the first "
                                              "--model in this process, as a node at <tracker URL>/node; with "
                                              "layer 0 the tracker answers chat as the entry itself (ADR-0044)."),
        node_id: str = typer.Option("tracker", "--node-id", help="With --serve-layers: the node id of those layers."),
        public_url: str = typer.Option(None, "--public-url",
                                       help="With --serve-layers: the tracker's URL as others reach it "
                                            "(default http://HOST:PORT); its node is at that URL + /node."),
        memory: int = typer.Option(None, "--memory", min=1, help="With --serve-layers: memory budget in MB."),
        dtype: str = DtypeOpt,
        wire_dtype: str = typer.Option(N.wire_dtype, "--wire-dtype", help="With --serve-layers: activation dtype."),
        threads: int = ThreadsOpt,
        state_dir: Path = typer.Option(None, "--state-dir", envvar="MESHNET_STATE_DIR",
                                       help="With --serve-layers: where its node keeps its key "
                                            "(default: <cache>/nodes/<node id>)."),
        challenges: bool = typer.Option(T.admission_challenges, "--challenges/--no-challenges",
                                        envvar="MESHNET_ADMISSION_CHALLENGES",
                                        help="Challenge each new shard against an admitted holder of its layers "
                                             "before routing it (off: digest check only, shards admitted unverified)."),
        spot_check_rate: float = typer.Option(N.spot_check_rate, "--spot-check-rate", min=0.0, max=1.0,
                                              envvar="MESHNET_SPOT_CHECK_RATE",
                                              help="With --serve-layers from layer 0, as the entry: share of sessions "
                                                   "whose hops are also run on a second holder and compared "
                                                   "(ADR-0042; 0 disables)."),
        log_level: str = LogOpt) -> None:
    """Start a tracker that keeps the given models covered. Beyond loopback it needs --join-token
    and --operator-token (or --insecure). With --serve-layers it also serves those layers itself."""
    from meshnet.models.sources import cache_dir
    from meshnet.presets import get_preset
    from meshnet.tracker.app import build_app
    from meshnet.tracker.auth import exposure_problem, is_loopback
    from meshnet.tracker.service import TrackerService, TrackerSettings

    setup_logging(log_level)
    problem = exposure_problem(host, join_token, operator_token, insecure)
    if problem:
        fail(MeshnetError(problem, code="insecure_tracker"))
    if insecure and not is_loopback(host) and not (join_token and operator_token):
        err_console.print(f"[bold red]INSECURE (--insecure): the tracker listens on {host} without a join token "
                          "or an operator token: anyone who reaches it can join nodes or run operator actions[/]",
                          highlight=False)
    try:
        names = tuple(get_preset(m).name for m in model)
        if serve_layers is not None and not names:
            from meshnet.presets import default_model

            names = (get_preset(default_model()).name,)
    except MeshnetError as exc:
        fail(exc)
    if db is None:
        cache_dir().mkdir(parents=True, exist_ok=True)
        db = str(cache_dir() / "tracker.db")
    settings = TrackerSettings(host=host, port=port, models=names, heartbeat_interval_s=heartbeat_interval,
                               node_timeout_s=node_timeout, rebalance_interval_s=rebalance_interval, db_path=db,
                               operator_token=operator_token, join_token=join_token, insecure=insecure,
                               join_settle_s=join_settle,
                               probe_timeout_s=probe_timeout, drain_grace_s=drain_grace,
                               directive_retention_s=directive_retention, admission_challenges=challenges,
                               **_body_limit(max_body_bytes))
    try:
        service = TrackerService(settings)  # opens the database now: an unreachable one fails here, clearly
    except MeshnetError as exc:
        fail(exc)
    if serve_layers is None:
        _serve(build_app(settings, service), host, port)
        return
    from meshnet import trackernode

    node = _tracker_node_settings(settings, names[0], serve_layers, node_id=node_id, public_url=public_url,
                                  memory=memory, dtype=dtype, wire_dtype=wire_dtype, threads=threads,
                                  state_dir=state_dir, spot_check_rate=spot_check_rate)
    app = trackernode.build_app(settings, node, service=service)
    print(f"meshnet tracker at {trackernode.local_tracker_url(host, port)} serving {names[0]} layers "
          f"{serve_layers} as node {node.node_id} at {node.endpoint}", flush=True)
    _serve(app, host, port)


def _tracker_node_settings(tracker, model: str, serve_layers: str, *, node_id: str, public_url: str | None,
                           memory: int | None, dtype: str, wire_dtype: str, threads: int | None,
                           state_dir: Path | None, spot_check_rate: float = N.spot_check_rate):
    """The settings of the node a tracker runs for ``--serve-layers`` (ADR-0044); exits on a bad
    range or URL. Sets torch's thread count to the one chosen."""
    from meshnet.node.calibration import usable_cores
    from meshnet.layers import LayerRange
    from meshnet.node.settings import NodeSettings
    from meshnet.presets import get_preset
    from meshnet.trackernode import local_tracker_url, node_endpoint

    try:
        layers = LayerRange.parse(serve_layers)
    except ValueError as exc:
        fail(MeshnetError(f"--serve-layers: {exc}", hint="an inclusive range like 0-9"))
    num_layers = get_preset(model).num_layers
    if layers.end > num_layers:
        fail(MeshnetError(f"--serve-layers {serve_layers} is beyond {model}'s {num_layers} layers "
                          f"(the last is {num_layers - 1})"))
    try:
        public_url = None if public_url is None else check_endpoint(public_url)
    except MeshnetError as exc:
        fail(exc)
    if wire_dtype not in ("float32", "bfloat16"):
        fail(MeshnetError(f"--wire-dtype must be float32 or bfloat16, got {wire_dtype!r}"))
    choice = compute_defaults(model, dtype, threads, usable_cores())
    err_console.print(f"compute: {choice.compute_dtype}, {choice.threads} thread(s): {choice.reason}", highlight=False)
    import torch

    torch.set_num_threads(choice.threads)
    own_url = local_tracker_url(tracker.host, tracker.port)
    return NodeSettings(host=tracker.host, port=tracker.port, public_url=node_endpoint(public_url or own_url),
                        node_id=node_id, tracker_url=own_url, join_token=tracker.join_token, state_dir=state_dir,
                        model=model, shard=layers, memory_bytes=None if memory is None else memory * 1024 * 1024,
                        compute_dtype=choice.compute_dtype, wire_dtype=wire_dtype,
                        heartbeat_interval_s=tracker.heartbeat_interval_s, torch_threads=choice.threads,
                        drain_grace_s=tracker.drain_grace_s, spot_check_rate=spot_check_rate)


@node_app.command("start")
def node_start(
        tracker: list[str] = typer.Option(None, "--tracker", envvar="MESHNET_TRACKER",
                                          help="Tracker URL to join; repeat it (or separate by commas) for every "
                                               "tracker of one database: the node moves on when one stops answering."),
        model: str = typer.Option(None, "--model", "-m", help="Preset, hub repo or local dir to serve (pinned)."),
        shard_start: int = typer.Option(None, "--shard-start", min=0, help="First layer (inclusive)."),
        shard_end: int = typer.Option(None, "--shard-end", min=0, help="Last layer (inclusive)."),
        memory: int = typer.Option(None, "--memory", min=1, help="Memory budget in MB (default: detected)."),
        max_shards: int = typer.Option(N.max_loaded_shards, "--max-shards", min=1, help="Shard slots (loaded shards at once)."),
        dtype: str = DtypeOpt,
        quantization: str = typer.Option(N.quantization, "--quantization", help="Recipe: bfloat16, int8, nf4."),
        wire_dtype: str = typer.Option(N.wire_dtype, "--wire-dtype", help="Activation dtype on the wire."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
        port: int = typer.Option(0, "--port", help="Port (default: a free one)."),
        public_url: str = typer.Option(None, "--public-url", help="URL others use to reach this node."),
        node_id: str = typer.Option(None, "--node-id", help="Node id (default: random)."),
        join_token: str = typer.Option(None, "--join-token", envvar="MESHNET_JOIN_TOKEN",
                                       help="The tracker's join token (trackers beyond loopback require one)."),
        state_dir: Path = typer.Option(None, "--state-dir", envvar="MESHNET_STATE_DIR",
                                       help="Where the node keeps its key (default: <cache>/nodes/<node id>)."),
        heartbeat_interval: float = typer.Option(N.heartbeat_interval_s, "--heartbeat-interval", min=0.1, help="Seconds."),
        no_placement: bool = typer.Option(False, "--no-placement", help="Refuse tracker-assigned shards."),
        threads: int = ThreadsOpt,
        max_body_bytes: int = MaxBodyOpt,
        session_cache_mb: int = typer.Option(N.session_cache_bytes >> 20, "--session-cache-mb", min=1, envvar="MESHNET_SESSION_CACHE_MB",
                                             help="KV-cache memory for sessions, MB; new sessions are refused "
                                                  "past it (live ones are never evicted)."),
        session_ttl: float = typer.Option(N.session_ttl_s, "--session-ttl", min=1.0, envvar="MESHNET_SESSION_TTL",
                                          help="Seconds an idle session's KV cache is kept."),
        hop_timeout: float = typer.Option(N.hop_timeout_s, "--hop-timeout", min=1.0, envvar="MESHNET_HOP_TIMEOUT",
                                          help="Seconds one hop call may take (entry nodes)."),
        hop_connect_timeout: float = typer.Option(N.hop_connect_timeout_s, "--hop-connect-timeout", min=0.1,
                                                  envvar="MESHNET_HOP_CONNECT_TIMEOUT",
                                                  help="Seconds to connect to a hop before failing over."),
        hop_streams: bool = typer.Option(N.hop_streams, "--hop-streams/--no-hop-streams", envvar="MESHNET_HOP_STREAMS",
                                         help="Entry nodes drive generations as a chain of hop streams "
                                              "(off: one HTTP call per hop per step)."),
        wallet: str = typer.Option("", "--wallet", envvar="MESHNET_WALLET", help="Wallet reported to the tracker."),
        batch_window_ms: float = typer.Option(N.batch_window_s * 1000, "--batch-window-ms", min=0.0,
                                              envvar="MESHNET_BATCH_WINDOW_MS",
                                              help="Longest wait for other sessions' decode steps to batch with, ms "
                                                   "(none while only one session is active; stretched to half "
                                                   "a batch's compute time on a slow host)."),
        max_batch: int = typer.Option(N.max_batch_size, "--max-batch", min=1, envvar="MESHNET_MAX_BATCH",
                                      help="Most sessions' steps in one batched forward."),
        spot_check_rate: float = typer.Option(N.spot_check_rate, "--spot-check-rate", min=0.0, max=1.0,
                                              envvar="MESHNET_SPOT_CHECK_RATE",
                                              help="As an entry: share of sessions whose hops are also run on a "
                                                   "second holder and compared (0 disables)."),
        drain_grace: float = DrainOpt,
        relay: bool = typer.Option(False, "--relay", envvar="MESHNET_RELAY",
                                   help="Serve only through a relay (behind NAT or a firewall): keep one outbound "
                                        "tunnel to --relay-url (default: the tracker)."),
        relay_url: str = typer.Option(None, "--relay-url", envvar="MESHNET_RELAY_URL",
                                      help="Relay to attach to: the tracker (default) or a node started with "
                                           "--offer-relay."),
        no_auto_relay: bool = typer.Option(False, "--no-auto-relay",
                                           help="When the tracker cannot reach this node, stay unadmitted instead "
                                                "of serving through a relay."),
        offer_relay: bool = typer.Option(False, "--offer-relay",
                                         help="Relay other (unreachable) nodes' traffic through this node."),
        log_level: str = LogOpt) -> None:
    """Start a node. With --model and --shard-start/--shard-end it serves that shard (pinned); with
    --model alone it asks the tracker which range to take; with neither it waits for directives.
    A node the tracker cannot reach serves through a relay (ADR-0045)."""
    from meshnet.layers import LayerRange
    from meshnet.node.settings import NodeSettings, new_node_id

    setup_logging(log_level)
    if (shard_start is None) != (shard_end is None):
        fail(MeshnetError("--shard-start and --shard-end go together"))
    if shard_start is not None and shard_end < shard_start:
        fail(MeshnetError("--shard-end must be >= --shard-start"))
    if (relay or relay_url or offer_relay) and not tracker:
        fail(MeshnetError("--relay, --relay-url and --offer-relay need --tracker",
                          hint="a relayed node registers its relayed endpoint with a tracker"))
    if model and shard_start is None and not tracker:
        fail(MeshnetError("--model without a shard needs --tracker to ask for a range",
                          hint="pass --shard-start/--shard-end, or --tracker URL"))
    try:
        public_url = None if public_url is None else check_endpoint(public_url)
        tracker = ",".join(check_endpoints(tracker)) if tracker else None
        relay_url = None if relay_url is None else check_endpoint(relay_url)
        port = port or free_port(host)
    except MeshnetError as exc:
        fail(exc)
    except OSError as exc:
        fail(MeshnetError(f"cannot pick a free port on --host {host}: {exc}",
                          hint="pass an address of this machine (127.0.0.1, ::1, 0.0.0.0) or --port"))
    from meshnet.node.calibration import usable_cores

    choice = compute_defaults(model, dtype, threads, usable_cores())
    print(f"compute: {choice.compute_dtype}, {choice.threads} thread(s): {choice.reason}", flush=True)
    dtype, threads = choice.compute_dtype, choice.threads
    import torch

    torch.set_num_threads(threads)
    settings = NodeSettings(host=host, port=port, public_url=public_url, node_id=node_id or new_node_id(),
                            tracker_url=tracker, join_token=join_token, state_dir=state_dir, model=model,
                            shard=None if shard_start is None else LayerRange.from_inclusive(shard_start, shard_end),
                            memory_bytes=None if memory is None else memory * 1024 * 1024,
                            max_loaded_shards=max_shards, compute_dtype=dtype, quantization=quantization,
                            wire_dtype=wire_dtype, heartbeat_interval_s=heartbeat_interval,
                            accepts_placement=not no_placement, torch_threads=threads,
                            session_cache_bytes=session_cache_mb * 1024 * 1024, session_ttl_s=session_ttl,
                            hop_timeout_s=hop_timeout, hop_connect_timeout_s=hop_connect_timeout, wallet=wallet,
                            hop_streams=hop_streams, drain_grace_s=drain_grace, relay=relay or relay_url is not None, relay_url=relay_url,
                            batch_window_s=batch_window_ms / 1000, max_batch_size=max_batch,
                            auto_relay=not no_auto_relay, offer_relay=offer_relay, spot_check_rate=spot_check_rate, **_body_limit(max_body_bytes))
    from meshnet.node.app import build_app

    app = build_app(settings)
    print(f"meshnet node {settings.node_id} listening on {settings.endpoint}", flush=True)
    _serve(app, host, port)
