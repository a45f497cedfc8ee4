"""Node settings: one frozen object, one place for defaults (CLI flag > MESHNET_* env > default)."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from meshnet.endpoints import base_url
from meshnet.layers import LayerRange
from meshnet.protocol.http import DEFAULT_MAX_BODY_BYTES
from meshnet.protocol.limits import DEFAULT_MAX_CLIENT_REQUESTS


@dataclass(frozen=True)
class NodeSettings:
    """Everything a node process needs.

    Attributes:
        host, port: where the node listens; ``public_url`` what others use to reach it.
        tracker_url: tracker to register with (None: standalone).
        join_token: the tracker's join token, sent with registrations (None: none required).
        state_dir: where the node keeps its key (``node.key``); None: ``<cache>/nodes/<node_id>``
            (:mod:`meshnet.node.identity`).
        model: model preset or path to serve; ``shard`` its layers (None: ask the tracker).
        memory_bytes: memory budget (None: detected RAM); ``max_loaded_shards``: slots.
        compute_dtype: ``float32``, ``bfloat16`` (or ``float16`` on a GPU); ``quantization``: recipe name.
        device: ``cpu`` or ``cuda:N``, where the shards run (:mod:`meshnet.models.devices`).
        wire_dtype: activation dtype this node sends as an entry node.
        heartbeat_interval_s: seconds between heartbeats (DESIGN: 10 s).
        session_ttl_s, session_cache_bytes: idle seconds before a KV-cache session expires, and
            the cap in bytes above which new sessions are refused (live ones are never evicted).
        hop_timeout_s: seconds one hop call may take in all; ``hop_connect_timeout_s`` to connect
            (short, so an unreachable hop fails over in seconds, not after ``hop_timeout_s``).
        hop_streams: drive generations as a chain of hop streams (ADR-0040); off: one
            ``POST /v1/forward`` per hop per step from the entry (the fallback path).
        accepts_placement: let the tracker assign shards (managed placement).
        torch_threads: intra-op threads (None: torch default).
        max_body_bytes: largest JSON request body (413 above; see
            :data:`meshnet.protocol.http.DEFAULT_MAX_BODY_BYTES`); ``/v1/forward`` frames
            are bounded by the wire format's own limit instead.
        drain_grace_s: on SIGTERM, seconds in-flight generations and hop sessions may take to
            finish before the node leaves (ADR-0032).
        batch_window_s: longest wait, seconds, for other sessions' decode steps after one reaches an
            idle node (none when only one session is active; stretched to half a batch's recent
            compute time when that is longer); ``max_batch_size``: most steps in one batched
            forward (ADR-0052). Every step, a lone one included, runs in the batcher's worker
            thread: an event loop only moves bytes (ADR-0049).
        spot_check_rate: as an entry node, the share of sessions whose first call to each hop is
            also run on a second holder and compared (ADR-0042; 0 disables).
        audit_rate: as an entry node, the share of sessions whose every hop is re-run on a second
            holder after the session, every position, from the hops' signed transcripts
            (ADR-0067; sessions through a hop still on probation are audited more often; 0 disables).
        speculate: as an entry node, speculative decoding (ADR-0058): ``auto``, ``off`` or a fixed
            draft count (:func:`meshnet.gateway.speculation.parse_speculate`).
        drain_hop_idle_s: while draining, a hop session untouched this long counts as over
            (its entry finished without releasing it, or died), seconds.
        relay: reach this node only through a relay, from the start (ADR-0045).
        relay_url: the relay to attach to (None: the tracker).
        auto_relay: when the tracker cannot reach ``endpoint``, attach to the relay by itself.
        offer_relay: relay other nodes' traffic (this node must be reachable itself).
        max_client_requests: as an entry node, chat and completion requests one client may have in
            flight at once (:mod:`meshnet.protocol.limits`, ADR-0060; its tracker's proxied chats and
            loopback clients are not counted; 0: no limit).
    """

    host: str = "127.0.0.1"
    port: int = 0
    public_url: str | None = None
    node_id: str = ""
    tracker_url: str | None = None
    join_token: str | None = None
    state_dir: Path | None = None
    model: str | None = None
    shard: LayerRange | None = None
    memory_bytes: int | None = None
    max_loaded_shards: int = 1
    compute_dtype: str = "bfloat16"
    device: str = "cpu"
    quantization: str = "bfloat16"
    wire_dtype: str = "bfloat16"
    heartbeat_interval_s: float = 10.0
    session_ttl_s: float = 300.0
    session_cache_bytes: int = 1 << 30
    hop_timeout_s: float = 60.0
    hop_connect_timeout_s: float = 5.0
    hop_streams: bool = True
    accepts_placement: bool = True
    wallet: str = ""
    torch_threads: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_grace_s: float = 30.0
    drain_hop_idle_s: float = 5.0
    relay: bool = False
    relay_url: str | None = None
    auto_relay: bool = True
    offer_relay: bool = False
    batch_window_s: float = 0.005
    max_batch_size: int = 16
    max_client_requests: int = DEFAULT_MAX_CLIENT_REQUESTS

    @property
    def worker_threads(self) -> int:
        """Worker threads of the node's event loop: enough for every caller of a full batch to wait
        in one while the batch runs, plus the codec and LM-head calls around them."""
        return max(32, 4 * self.max_batch_size)
    spot_check_rate: float = 0.02
    audit_rate: float = 0.06
    speculate: str = "auto"

    @property
    def endpoint(self) -> str:
        """Base URL others reach this node at: ``public_url``, else ``http://host:port`` (IPv6 bracketed)."""
        return self.public_url or base_url(self.host, self.port)

    @property
    def local_url(self) -> str:
        """Where this machine reaches the node's own listener (a relay tunnel replays requests
        there): loopback of the listening family for a wildcard host, else the host itself."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return base_url(host, self.port)


def new_node_id() -> str:
    """A fresh node id (``node-`` + 8 hex chars) unless ``MESHNET_NODE_ID`` is set."""
    return os.environ.get("MESHNET_NODE_ID") or f"node-{uuid.uuid4().hex[:8]}"
