"""Each service's command-line options, stated once, and the settings they build.

A command's flags are the fields of one options class (a dataclass whose defaults are
``typer.Option`` declarations); :func:`takes` hands Typer those fields as the command's
parameters and the command one instance of the class. Every default a flag shows is read from
the settings class it feeds (:class:`~meshnet.node.settings.NodeSettings`,
:class:`~meshnet.tracker.service.TrackerSettings`), so ``node start``, ``tracker start`` and
``serve`` never disagree with the services they start.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import typer

from meshnet.cli.output import fail
from meshnet.endpoints import check_endpoint, check_endpoints, free_port
from meshnet.errors import MeshnetError
from meshnet.node.settings import NodeSettings as N
from meshnet.protocol.limits import DEFAULT_MAX_CLIENT_REQUESTS
from meshnet.tracker.service import TrackerSettings as T

MB = 1024 * 1024


def takes(options_class: type):
    """Decorator: Typer sees the fields of the dataclass ``options_class`` as the command's
    parameters; the command receives one ``options_class`` instance built from them."""
    hints = typing.get_type_hints(options_class)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
              for f in fields(options_class)]

    def wrap(command):
        @functools.wraps(command)
        def run(**flags) -> None:
            command(options_class(**flags))

        del run.__wrapped__  # Typer reads the parameters below, not the command's one argument
        run.__signature__ = inspect.Signature(params, return_annotation=None)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


def log_level_option():
    return typer.Option(None, "--log-level", help="DEBUG, INFO, WARNING (env MESHNET_LOG_LEVEL).")


def drain_option():
    return typer.Option(N.drain_grace_s, "--drain-grace", min=0.0, envvar="MESHNET_DRAIN_GRACE",
                        help="On SIGTERM, seconds in-flight generations may take to finish before they are cut.")


def max_body_option():
    return typer.Option(None, "--max-body-bytes", envvar="MESHNET_MAX_BODY_BYTES", min=1024,
                        help="Largest JSON request body, bytes; bigger ones get 413 (default 8 MiB).")


def dtype_option():
    return typer.Option("auto", "--dtype",
                        help="Compute dtype: auto (on a CPU measured on this host: bfloat16 when clearly faster, else "
                             "the exact float32; on a GPU bfloat16, or float16 where it has no bfloat16), float32, "
                             "bfloat16 or float16 (GPU only).")


def device_option(help: str = "Where the shards run: auto (the first CUDA GPU when torch sees one, else the CPU), "
                              "cpu, cuda or cuda:N. On a GPU the node offers the GPU's free memory."):
    return typer.Option("auto", "--device", envvar="MESHNET_DEVICE", help=help)


def threads_option(help: str = "torch intra-op threads (default: measured on this host, at most the usable cores)."):
    return typer.Option(None, "--threads", min=1, help=help)


def wire_dtype_option(help: str = "Activation dtype on the wire."):
    return typer.Option(N.wire_dtype, "--wire-dtype", help=help)


def spot_check_option(help: str):
    return typer.Option(N.spot_check_rate, "--spot-check-rate", min=0.0, max=1.0, envvar="MESHNET_SPOT_CHECK_RATE",
                        help=help)


def audit_option(help: str = "As an entry: share of sessions whose every hop is re-run on a second holder after "
                              "the session, every position, from the hops' signed transcripts (ADR-0067; higher "
                              "while a hop is on probation; 0 disables)."):
    return typer.Option(N.audit_rate, "--audit-rate", min=0.0, max=1.0, envvar="MESHNET_AUDIT_RATE", help=help)


def _check_speculate(value: str) -> str:
    from meshnet.gateway.speculation import parse_speculate

    try:
        parse_speculate(value)
    except MeshnetError as exc:
        raise typer.BadParameter(exc.message) from None
    return value


def speculate_option(help: str = "As an entry: speculative decoding (ADR-0058): auto drafts by prompt lookup and "
                                 "sizes each step's drafts by measured acceptance and step cost; off; or a fixed "
                                 "draft count K (0-16)."):
    return typer.Option(N.speculate, "--speculate", envvar="MESHNET_SPECULATE", callback=_check_speculate, help=help)


def heartbeat_option(help: str = "Node heartbeat, s."):
    return typer.Option(T.heartbeat_interval_s, "--heartbeat-interval", min=0.1, help=help)


def client_requests_option(help: str = "Chat and completion requests one client (its bearer key, else its "
                                        "address; loopback is not counted) may have in flight at once; the "
                                        "next is a 429 (ADR-0060). 0: no limit."):
    return typer.Option(DEFAULT_MAX_CLIENT_REQUESTS, "--max-client-requests", min=0,
                        envvar="MESHNET_MAX_CLIENT_REQUESTS", help=help)


def body_limit(max_body_bytes: int | None) -> dict:
    """Settings keyword for ``--max-body-bytes`` (none: the settings' default)."""
    return {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}


@dataclass
class NodeOptions:
    """``meshnet node start``'s flags; :meth:`settings` turns them into :class:`NodeSettings`."""

    tracker: list[str] | None = typer.Option(
        None, "--tracker", envvar="MESHNET_TRACKER",
        help="Tracker URL to join; repeat it (or separate by commas) for every tracker of one database: the node "
             "moves on when one stops answering.")
    model: str | None = typer.Option(None, "--model", "-m",
                                     help="Preset, hub repo or local dir to serve: with --shard-start/--shard-end "
                                          "that range (pinned), alone the range the tracker gives.")
    shard_start: int | None = typer.Option(None, "--shard-start", min=0, help="First layer (inclusive).")
    shard_end: int | None = typer.Option(None, "--shard-end", min=0, help="Last layer (inclusive).")
    memory: int | None = typer.Option(None, "--memory", min=1, help="Memory budget in MB (default: detected).")
    max_shards: int = typer.Option(N.max_loaded_shards, "--max-shards", min=1,
                                   help="Shard slots (loaded shards at once).")
    dtype: str = dtype_option()
    device: str = device_option()
    quantization: str = typer.Option(
        N.quantization, "--quantization",
        help="Recipe: bfloat16, float32, int8, int4 (CPU), nf4, or auto (the fastest on this host within the "
             "doctor's tolerance, measured once and kept; it sets the compute dtype too).")
    wire_dtype: str = wire_dtype_option()
    host: str = typer.Option(N.host, "--host", help="Address to listen on.")
    port: int = typer.Option(N.port, "--port", help="Port (default: a free one).")
    public_url: str | None = typer.Option(None, "--public-url", help="URL others use to reach this node.")
    node_id: str | None = typer.Option(None, "--node-id", help="Node id (default: random).")
    join_token: str | None = typer.Option(None, "--join-token", envvar="MESHNET_JOIN_TOKEN",
                                          help="The tracker's join token (trackers beyond loopback require one).")
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="MESHNET_STATE_DIR",
                                          help="Where the node keeps its key (default: <cache>/nodes/<node id>).")
    heartbeat_interval: float = typer.Option(N.heartbeat_interval_s, "--heartbeat-interval", min=0.1,
                                             help="Seconds.")
    no_placement: bool = typer.Option(False, "--no-placement", help="Refuse tracker-assigned shards.")
    threads: int | None = threads_option()
    max_body_bytes: int | None = max_body_option()
    max_client_requests: int = client_requests_option()
    session_cache_mb: int = typer.Option(N.session_cache_bytes // MB, "--session-cache-mb", min=1,
                                         envvar="MESHNET_SESSION_CACHE_MB",
                                         help="KV-cache memory for sessions, MB; new sessions are refused past it "
                                              "(live ones are never evicted).")
    session_ttl: float = typer.Option(N.session_ttl_s, "--session-ttl", min=1.0, envvar="MESHNET_SESSION_TTL",
                                      help="Seconds an idle session's KV cache is kept.")
    hop_timeout: float = typer.Option(N.hop_timeout_s, "--hop-timeout", min=1.0, envvar="MESHNET_HOP_TIMEOUT",
                                      help="Seconds one hop call may take (entry nodes).")
    hop_connect_timeout: float = typer.Option(N.hop_connect_timeout_s, "--hop-connect-timeout", min=0.1,
                                              envvar="MESHNET_HOP_CONNECT_TIMEOUT",
                                              help="Seconds to connect to a hop before failing over.")
    hop_streams: bool = typer.Option(N.hop_streams, "--hop-streams/--no-hop-streams", envvar="MESHNET_HOP_STREAMS",
                                     help="Entry nodes drive generations as a chain of hop streams (off: one HTTP "
                                          "call per hop per step).")
    wallet: str = typer.Option(N.wallet, "--wallet", envvar="MESHNET_WALLET", help="Wallet reported to the tracker.")
    batch_window_ms: float = typer.Option(N.batch_window_s * 1000, "--batch-window-ms", min=0.0,
                                          envvar="MESHNET_BATCH_WINDOW_MS",
                                          help="Longest wait for other sessions' decode steps to batch with, ms "
                                               "(none while only one session is active; stretched to half a batch's "
                                               "compute time on a slow host).")
    max_batch: int = typer.Option(N.max_batch_size, "--max-batch", min=1, envvar="MESHNET_MAX_BATCH",
                                  help="Most sessions' steps in one batched forward.")
    spot_check_rate: float = spot_check_option("As an entry: share of sessions whose hops are also run on a second "
                                               "holder and compared (0 disables).")
    audit_rate: float = audit_option()
    speculate: str = speculate_option()
    drain_grace: float = drain_option()
    relay: bool = typer.Option(False, "--relay", envvar="MESHNET_RELAY",
                               help="Serve only through a relay (behind NAT or a firewall): keep one outbound tunnel "
                                    "to --relay-url (default: the tracker).")
    relay_url: str | None = typer.Option(None, "--relay-url", envvar="MESHNET_RELAY_URL",
                                         help="Relay to attach to: the tracker (default) or a node started with "
                                              "--offer-relay.")
    no_auto_relay: bool = typer.Option(False, "--no-auto-relay",
                                       help="When the tracker cannot reach this node, stay unadmitted instead of "
                                            "serving through a relay.")
    offer_relay: bool = typer.Option(False, "--offer-relay",
                                     help="Relay other (unreachable) nodes' traffic through this node.")
    log_level: str | None = log_level_option()

    def check(self) -> None:
        """Exit with a clear error on flags that contradict each other; normalise the URLs and pick a
        free port when none is given."""
        if (self.shard_start is None) != (self.shard_end is None):
            fail(MeshnetError("--shard-start and --shard-end go together"))
        if self.shard_start is not None and self.shard_end < self.shard_start:
            fail(MeshnetError("--shard-end must be >= --shard-start"))
        if self.quantization == "auto" and self.dtype != "auto":  # before anything is measured
            fail(MeshnetError("--quantization auto chooses the compute dtype too: leave --dtype out, or name a recipe"))
        if (self.relay or self.relay_url or self.offer_relay) and not self.tracker:
            fail(MeshnetError("--relay, --relay-url and --offer-relay need --tracker",
                              hint="a relayed node registers its relayed endpoint with a tracker"))
        if self.model and self.shard_start is None and not self.tracker:
            fail(MeshnetError("--model without a shard needs --tracker to ask for a range",
                              hint="pass --shard-start/--shard-end, or --tracker URL"))
        try:
            self.public_url = None if self.public_url is None else check_endpoint(self.public_url)
            self.tracker = check_endpoints(self.tracker) if self.tracker else None
            self.relay_url = None if self.relay_url is None else check_endpoint(self.relay_url)
            self.port = self.port or free_port(self.host)
        except MeshnetError as exc:
            fail(exc)
        except OSError as exc:
            fail(MeshnetError(f"cannot pick a free port on --host {self.host}: {exc}",
                              hint="pass an address of this machine (127.0.0.1, ::1, 0.0.0.0) or --port"))

    def settings(self, compute_dtype: str, threads: int, device: str = "cpu"):
        """The node's :class:`NodeSettings` (after :meth:`check`), with the compute dtype, threads
        and device (``cpu``, ``cuda:N``) chosen for this host."""
        from meshnet.layers import LayerRange
        from meshnet.node.settings import NodeSettings, new_node_id

        shard = None if self.shard_start is None else LayerRange.from_inclusive(self.shard_start, self.shard_end)
        return NodeSettings(
            host=self.host, port=self.port, public_url=self.public_url, node_id=self.node_id or new_node_id(),
            tracker_url=",".join(self.tracker) if self.tracker else None, join_token=self.join_token,
            state_dir=self.state_dir, model=self.model, shard=shard,
            memory_bytes=None if self.memory is None else self.memory * MB, max_loaded_shards=self.max_shards,
            compute_dtype=compute_dtype, device=device, quantization=self.quantization, wire_dtype=self.wire_dtype,
            heartbeat_interval_s=self.heartbeat_interval, accepts_placement=not self.no_placement,
            torch_threads=threads, session_cache_bytes=self.session_cache_mb * MB, session_ttl_s=self.session_ttl,
            hop_timeout_s=self.hop_timeout, hop_connect_timeout_s=self.hop_connect_timeout, wallet=self.wallet,
            hop_streams=self.hop_streams, drain_grace_s=self.drain_grace,
            relay=self.relay or self.relay_url is not None, relay_url=self.relay_url,
            batch_window_s=self.batch_window_ms / 1000, max_batch_size=self.max_batch,
            auto_relay=not self.no_auto_relay, offer_relay=self.offer_relay, spot_check_rate=self.spot_check_rate,
            audit_rate=self.audit_rate, speculate=self.speculate, max_client_requests=self.max_client_requests,
            **body_limit(self.max_body_bytes))


@dataclass
class TrackerOptions:
    """``meshnet tracker start``'s flags; :meth:`settings` turns them into :class:`TrackerSettings`.
    The ``--serve-layers`` group configures the node a tracker may run itself (ADR-0044)."""

    model: list[str] = typer.Option([], "--model", "-m", help="Preset to keep covered (repeatable).")
    host: str = typer.Option(T.host, "--host", help="Address to listen on.")
    port: int = typer.Option(T.port, "--port", help="Port to listen on.")
    db: str | None = typer.Option(
        None, "--db", envvar="MESHNET_TRACKER_DB",
        help="sqlite file for the tracker's state (default: ~/.cache/meshnet/tracker.db), or "
             "postgresql://user@host:5432/db: several trackers may share that database, one leading, the others "
             "standing by.")
    heartbeat_interval: float = heartbeat_option()
    node_timeout: float = typer.Option(T.node_timeout_s, "--node-timeout", min=0.5, help="Dropout after this many s.")
    rebalance_interval: float = typer.Option(T.rebalance_interval_s, "--rebalance-interval", min=0.5,
                                             help="Rebalance period, s.")
    join_settle: float = typer.Option(T.join_settle_s, "--join-settle", min=0.0,
                                      help="Seconds to wait for more joins before placing, s.")
    operator_token: str | None = typer.Option(None, "--operator-token", envvar="MESHNET_OPERATOR_TOKEN",
                                              help="Bearer token required for operator actions (required beyond "
                                                   "loopback).")
    join_token: str | None = typer.Option(None, "--join-token", envvar="MESHNET_JOIN_TOKEN",
                                          help="Token a node must present to register (required beyond loopback).")
    insecure: bool = typer.Option(T.insecure, "--insecure",
                                  help="Listen beyond loopback without join/operator tokens, on purpose.")
    max_body_bytes: int | None = max_body_option()
    max_client_requests: int = client_requests_option()
    probe_timeout: float = typer.Option(T.probe_timeout_s, "--probe-timeout", min=0.1, envvar="MESHNET_PROBE_TIMEOUT",
                                        help="Seconds a node's endpoint has to answer the tracker's reachability "
                                             "probe; unreachable nodes are not admitted.")
    drain_grace: float = drain_option()
    directive_retention: float = typer.Option(T.directive_retention_s, "--directive-retention", min=0.0,
                                              envvar="MESHNET_DIRECTIVE_RETENTION",
                                              help="Seconds finished (done/failed) directives are kept.")
    serve_layers: str | None = typer.Option(
        None, "--serve-layers",
        help="Also serve these layers (inclusive 'A-B', e.g. 0-9) of the first --model in this process, as a node at "
             "<tracker URL>/node; with layer 0 the tracker answers chat as the entry itself (ADR-0044).")
    node_id: str = typer.Option("tracker", "--node-id", help="With --serve-layers: the node id of those layers.")
    public_url: str | None = typer.Option(None, "--public-url",
                                          help="With --serve-layers: the tracker's URL as others reach it (default "
                                               "http://HOST:PORT); its node is at that URL + /node.")
    memory: int | None = typer.Option(None, "--memory", min=1, help="With --serve-layers: memory budget in MB.")
    dtype: str = dtype_option()
    device: str = device_option("With --serve-layers: where its layers run (auto, cpu, cuda, cuda:N).")
    wire_dtype: str = wire_dtype_option("With --serve-layers: activation dtype.")
    threads: int | None = threads_option()
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="MESHNET_STATE_DIR",
                                          help="With --serve-layers: where its node keeps its key (default: "
                                               "<cache>/nodes/<node id>).")
    challenges: bool = typer.Option(T.admission_challenges, "--challenges/--no-challenges",
                                    envvar="MESHNET_ADMISSION_CHALLENGES",
                                    help="Challenge each new shard against an admitted holder of its layers before "
                                         "routing it (off: digest check only, shards admitted unverified).")
    require_verified: bool = typer.Option(T.require_verified, "--require-verified",
                                          envvar="MESHNET_REQUIRE_VERIFIED",
                                          help="Route only through shards verified against another holder or "
                                               "trusted with `meshnet trust`, never on a holder's word alone "
                                               "(ADR-0069).")
    source_references: str = typer.Option(T.source_references, "--source-references",
                                          envvar="MESHNET_SOURCE_REFERENCES",
                                          help="Where admission challenges' references come from (ADR-0070): auto "
                                               "(the model's own files where this host holds them, one layer in "
                                               "memory at a time; else other holders), fetch (fetch the files "
                                               "where this host lacks them), off (other holders only: the first "
                                               "holder of a range is admitted unverified).")
    speed_probe_interval: float = typer.Option(T.speed_probe_interval_s, "--speed-probe-interval", min=0,
                                               envvar="MESHNET_SPEED_PROBE_INTERVAL",
                                               help="Seconds between this tracker's timings of each admitted shard's "
                                                    "decode step (models with two or more holders); a node claiming "
                                                    "far more tokens/s than its timings show is routed at the timed "
                                                    "figure (ADR-0068; 0 disables).")
    spot_check_rate: float = spot_check_option("With --serve-layers from layer 0, as the entry: share of sessions "
                                               "whose hops are also run on a second holder and compared (ADR-0042; "
                                               "0 disables).")
    audit_rate: float = audit_option("With --serve-layers from layer 0, as the entry: share of sessions whose "
                                     "hops are re-run on a second holder after the session (ADR-0067; 0 disables).")
    speculate: str = speculate_option("With --serve-layers from layer 0, as the entry: speculative decoding "
                                      "(ADR-0058): auto, off, or a fixed draft count K (0-16).")
    log_level: str | None = log_level_option()

    def settings(self, models: tuple[str, ...], db: str):
        """The tracker's :class:`TrackerSettings` for ``models`` (preset names) on ``db``."""
        from meshnet.tracker.service import TrackerSettings

        return TrackerSettings(host=self.host, port=self.port, models=models,
                               heartbeat_interval_s=self.heartbeat_interval, node_timeout_s=self.node_timeout,
                               rebalance_interval_s=self.rebalance_interval, db_path=db,
                               operator_token=self.operator_token, join_token=self.join_token, insecure=self.insecure,
                               join_settle_s=self.join_settle, probe_timeout_s=self.probe_timeout,
                               drain_grace_s=self.drain_grace, directive_retention_s=self.directive_retention,
                               admission_challenges=self.challenges, max_client_requests=self.max_client_requests,
                               speed_probe_interval_s=self.speed_probe_interval,
                               require_verified=self.require_verified, source_references=self.source_references,
                               **body_limit(self.max_body_bytes))


#: shards ``meshnet serve`` splits the model into when the cores allow
DEFAULT_SHARDS = 3


@dataclass
class ServeOptions:
    """``meshnet serve``'s flags; the tracker's and nodes' own defaults where they pass through."""

    model: str | None = typer.Option(None, "--model", "-m", help="Preset to serve (default: the default preset).")
    nodes: int | None = typer.Option(None, "--nodes", "-n", min=1,
                                     help=f"Shards the layers are split into, one process each, the tracker serving "
                                          f"the first (default: {DEFAULT_SHARDS}, or the usable cores when fewer, so "
                                          f"no core runs two processes' threads).")
    tracker_layers: bool = typer.Option(True, "--tracker-layers/--no-tracker-layers",
                                        help="The tracker serves the first shard and answers chat as its entry "
                                             "(ADR-0044); without, a node process serves every shard.")
    port: int = typer.Option(T.port, "--port", help="Tracker port (the URL clients use).")
    dtype: str = typer.Option("auto", "--dtype",
                              help="Compute dtype: auto (measured on this host; a GPU's bfloat16 or float16), "
                                   "bfloat16, float32 (exact) or float16 (GPU only).")
    device: str = device_option("Where every process's shard runs: auto (the first CUDA GPU when torch sees one, "
                                "else the CPU), cpu, cuda or cuda:N.")
    wire_dtype: str = wire_dtype_option("Activation dtype between nodes.")
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the model to be routable.")
    threads: int | None = threads_option("torch threads per process (default: measured on this host within the "
                                         "usable cores split evenly between the processes).")
    heartbeat_interval: float = heartbeat_option("Seconds between heartbeats.")
    drain_grace: float = typer.Option(N.drain_grace_s, "--drain-grace", min=0.0,
                                      help="On stop, seconds chats in flight get to finish.")
    spot_check_rate: float = typer.Option(N.spot_check_rate, "--spot-check-rate", min=0.0, max=1.0,
                                          help="Share of sessions whose hops the entry also runs on a second holder "
                                               "and compares (ADR-0042; 0 disables).")
    audit_rate: float = audit_option("Share of sessions whose every hop the entry re-runs on a second holder after "
                                     "the session, every position, from the hops' signed transcripts (ADR-0067; "
                                     "higher while a hop is on probation; 0 disables).")
    speculate: str = speculate_option("The entry's speculative decoding (ADR-0058): auto (prompt-lookup drafts, as "
                                      "many per step as measured acceptance and step cost make pay), off, or a "
                                      "fixed draft count K (0-16).")
    max_client_requests: int = client_requests_option()
    exit_when_ready: bool = typer.Option(False, "--exit-when-ready", help="Stop everything once ready (smoke test).")
