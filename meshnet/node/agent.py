"""The node's side of the control loop: register, heartbeat, obey directives.

The agent registers the node's capabilities and shards (with their capability reports),
heartbeats every ``heartbeat_interval_s`` with stats, and applies the directives that come
back: ``LOAD_SHARD`` (load the weights for real, run doctor, then serve), ``DROP_SHARD``
(free them), ``RUN_DOCTOR`` and ``RELOAD``. Each directive's status (acked, done, failed)
travels back in the next heartbeat; a finished directive triggers an early heartbeat.

Self-healing (ADR-0045): a failed heartbeat is retried after a bounded, jittered back-off (never
later than the interval); a tracker that forgot the node (404) gets a new registration. A node
the tracker cannot reach (``--relay``, or the probe's verdict) attaches a relay tunnel
(:class:`meshnet.relay.tunnel.NodeTunnel`) and registers the relayed endpoint; the tunnel dials
again by itself whenever it drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os


from meshnet.client import NodeSigner, TrackerClient
from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange
from meshnet.node import hardware, identity
from meshnet.node.doctor import run_doctor
from meshnet.node.loader import load_shard
from meshnet.protocol.control import PROTOCOL_REVISION, CapabilityReport, Directive, DirectiveUpdate, HeartbeatRequest, NodeStats, RegisterResponse, RegisterRequest, ShardInfo, AuditReport
from meshnet.protocol.signing import decode_public_key, encode_public_key
from meshnet.protocol.route import Hop, Route
from meshnet.protocol.waits import wait_event
from meshnet.relay.backoff import Backoff
from meshnet.relay.tunnel import NodeTunnel
from meshnet.node.reachability import RelayMixin

log = logging.getLogger(__name__)

#: registration answers that retrying cannot change: the node stops with the tracker's message
REFUSALS = (400, 401, 403, 409, 422, 426)


class TrackerAgent(RelayMixin):
    """Keeps one node registered with its tracker. ``node`` is the app's NodeContext.

    Every call to the tracker is signed with the node's key (made on first start in its state
    dir, :mod:`meshnet.node.identity`); registrations carry the join token when configured.

    Raises:
        MeshnetError (``node_key``): the key cannot be read or made.
    """

    def __init__(self, node) -> None:
        self.node = node
        self.settings = node.settings
        state_dir = self.settings.state_dir or identity.default_state_dir(self.settings.node_id)
        #: this process's hold on the state directory: one node process per id and host
        self._state_lock: int | None = identity.lock_state_dir(state_dir, self.settings.node_id)
        key = identity.load_or_create_key(state_dir)
        self.key = key
        self.public_key = encode_public_key(key.public_key())
        #: signs this node's calls: to the tracker, and its session releases on hops (ADR-0038)
        self.signer = NodeSigner(self.settings.node_id, key)
        self.client = TrackerClient(self.settings.tracker_url, timeout_s=30.0, transport=node.transport,
                                    join_token=self.settings.join_token, auth=self.signer)
        self.hw = hardware.detect(self.settings.device)
        self.updates: list[DirectiveUpdate] = []
        self.wake = asyncio.Event()
        self.applying = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()
        #: seconds between heartbeats: the node's own setting until the tracker announces one, then
        #: the tracker's, shorter or longer: its dropout timeout is sized for the interval it
        #: announces, and it lengthens the interval as the network grows (ADR-0037)
        self.interval_s = self.settings.heartbeat_interval_s
        #: what the tracker said last about reaching this node's endpoint (None: nothing yet)
        self.reachable: bool | None = None
        self._probed_again = False  # the first "unreachable" verdict was taken as provisional
        self.last_ok_s: float | None = None   # monotonic time the tracker last accepted us
        self.last_error: str | None = None    # why the latest register/heartbeat failed, if it did
        self.leaving = False                  # deregistered (drain): no more heartbeats
        #: retry delays after a failed registration or heartbeat (bounded by the interval in :meth:`run`)
        self.backoff = Backoff(0.5, 5.0)
        self.failures = 0                      # heartbeats failed in a row
        #: the relay tunnel when this node is reached through a relay (ADR-0045), else None
        self.tunnel: NodeTunnel | None = None
        self._tunnel_task: asyncio.Task | None = None
        self._considering: asyncio.Task | None = None   # a running :meth:`consider_relay` check
        self._listening_since: float | None = None      # loop time the own listener first answered

    @property
    def endpoint(self) -> str:
        """What this node advertises: the relayed endpoint while it uses a relay, else its own."""
        return self.tunnel.endpoint if self.tunnel is not None else self.settings.endpoint

    # ---- payloads ---------------------------------------------------------------------

    def shards_payload(self) -> list[ShardInfo]:
        return [slot.describe(self.node.reports.get(key)) for key, slot in self.node.runtime.slots.items()]

    def registration(self) -> RegisterRequest:
        s = self.settings
        tokens_per_s = max((r.tokens_per_s for r in self.node.reports.values() if r), default=0.0)
        return RegisterRequest(protocol=PROTOCOL_REVISION, node_id=s.node_id, public_key=self.public_key,
                               wallet=s.wallet, endpoint=self.endpoint,
                               vram_bytes=hardware.node_memory_bytes(s.memory_bytes, self.hw),
                               ram_bytes=self.hw.ram_bytes, device=self.hw.device, quantizations=[s.quantization],
                               benchmark_tokens_per_sec=tokens_per_s,
                               benchmark_model=next(iter({sl.model for sl in self.node.runtime.slots.values()}), None),
                               max_loaded_shards=s.max_loaded_shards, accepts_placement=s.accepts_placement,
                               shards=self.shards_payload(),
                               relay_url=None if self.tunnel is None else self.tunnel.relay_url,
                               relay_rtt_s=0.0 if self.tunnel is None else round(self.tunnel.rtt_s, 6))

    def stats(self) -> NodeStats:
        stats = self.node.metrics.heartbeat_stats(self.node.runtime, rss_bytes=hardware.rss_bytes())
        if self.tunnel is not None:  # the relay leg each hop through this node pays (route cost, ADR-0045)
            stats = stats.model_copy(update={"relay_rtt_s": round(min(self.tunnel.rtt_s, 60.0), 6)})
        return stats

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self, attempts: int = 60) -> None:
        """Load the configured shard, then register (up to ``attempts`` tries, a jittered back-off
        of at most 5 s between them, while the tracker is unreachable or busy). With ``--relay`` the
        registration names the relayed endpoint and the tunnel attaches right after it (a relay
        admits only a node id it knows), waiting up to 10 s for the first attach.

        Raises:
            MeshnetError: a refusal that retrying cannot change (401 join token or signature, 403,
                409 node id bound to another key, 422, 426 protocol revision), or the last attempt's error.
        """
        await self.load_initial()
        if self.settings.relay:
            self.tunnel = self._new_tunnel()
        for attempt in range(attempts):
            try:
                resp = await self.client.register(self.registration())
                self.note_registered(resp)
                log.info("registered %s with %s", self.settings.node_id, self.client.url)
                if self.tunnel is not None:
                    await self.start_tunnel()
                return
            except MeshnetError as exc:
                self.last_error = exc.message
                if exc.status in REFUSALS:
                    log.error("the tracker refused this node: %s%s", exc.message,
                              f" (hint: {exc.hint})" if exc.hint else "")
                    raise
                if attempt == attempts - 1:
                    raise
                delay = self.backoff.next_delay_s()
                log.info("tracker not ready (%s); retrying in %.1f s", exc.message, delay)
                await asyncio.sleep(delay)

    async def load_initial(self) -> None:
        s = self.settings
        if not s.model:
            return
        layers, tier = s.shard, "pinned"
        if layers is None:  # ADR-0011: ask the tracker which range to take
            info = await self.client.assign(hf_repo=s.model, device=self.hw.device, quantization=s.quantization,
                                            vram_mb=hardware.node_memory_bytes(s.memory_bytes, self.hw) >> 20)
            layers, tier = LayerRange.from_inclusive(info.shard_start, info.shard_end), "bootstrap"
        await self.load(s.model, layers, tier)

    async def load(self, model: str, layers: LayerRange, tier: str) -> CapabilityReport:
        return await load_shard(self.node, model, layers, tier)

    async def run(self) -> None:
        """Heartbeat forever (cancelled by the app's lifespan); after a failed round, again after the
        back-off (at most the interval), so a tracker that comes back finds the node within seconds."""
        while True:
            wait_s = self.interval_s if not self.failures else min(self.interval_s, self.backoff.next_delay_s())
            await wait_event(self.wake, wait_s)
            self.wake.clear()
            try:
                await self.heartbeat()
            except Exception:  # noqa: BLE001 - one bad round must not stop the heartbeats for good
                self.failures += 1
                log.exception("heartbeat round failed; retrying after a back-off")

    async def heartbeat(self) -> None:
        if self.leaving:
            return
        if self.relay_lost():
            await self.fall_back_to_tracker_relay()
        updates, self.updates = self.updates, []
        payload = HeartbeatRequest(shards=self.shards_payload(), stats=self.stats(), directive_updates=updates)
        try:
            resp = await self.client.heartbeat(self.settings.node_id, payload)
        except MeshnetError as exc:
            self.updates = updates + self.updates
            self.last_error = exc.message
            self.failures += 1
            if exc.status == 404 and not (self.leaving or self.node.drain.draining):
                # the tracker forgot us (restart): register again; a draining node stays forgotten
                try:
                    again_resp = await self.client.register(self.registration())
                except MeshnetError as again:  # keep the loop alive: the next heartbeat tries again
                    self.last_error = again.message
                    log.warning("re-registration failed: %s", again.message)
                    return
                self.note_registered(again_resp)
                return
            log.warning("heartbeat failed: %s", exc.message)
            return
        self._ok()
        if self.failures:
            log.info("the tracker answers again after %d failed heartbeat(s)", self.failures)
        self.failures = 0
        self.backoff.reset()
        self.note_reachability(resp)
        self.follow_interval(resp.heartbeat_interval_s)
        directives = resp.directives
        for directive in directives:
            self.updates.append(DirectiveUpdate(id=directive.id, status="acked"))
        if directives:
            self.tasks.add(task := asyncio.create_task(self.apply_in_order(directives)))
            task.add_done_callback(self.tasks.discard)

    def note_registered(self, resp: RegisterResponse) -> None:
        """A registration (first or again) succeeded: take the tracker's key (from now on hop calls
        need its session tickets, ADR-0038), its heartbeat interval and its verdict on reaching
        this node."""
        self.node.tracker_key = decode_public_key(resp.tracker_key)
        self.failures = 0
        self.backoff.reset()
        self.follow_interval(resp.heartbeat_interval_s)
        self.note_reachability(resp)
        self._ok()

    def follow_interval(self, announced_s: float | None) -> None:
        """Heartbeat every ``announced_s`` seconds from now on, as the tracker asked (None: keep the
        current interval). Longer than the node's own setting too: the tracker's budget wins."""
        if announced_s is None or announced_s == self.interval_s:
            return
        log.info("heartbeat interval %.1f s (announced by the tracker, was %.1f s)", announced_s, self.interval_s)
        self.interval_s = announced_s

    # ---- relay (ADR-0045) ---------------------------------------------------------------

    async def close(self) -> None:
        """Stop the relay tunnel and a pending relay check, and let go of the state directory (the
        app's lifespan ends)."""
        for task in (self._tunnel_task, self._considering):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._state_lock is not None:
            os.close(self._state_lock)
            self._state_lock = None

    def wake_soon(self, delay_s: float) -> None:
        """Heartbeat early, in ``delay_s`` seconds (to learn the tracker's next verdict sooner)."""
        asyncio.get_running_loop().call_later(delay_s, self.wake.set)

    async def apply_in_order(self, directives: list[Directive]) -> None:
        """Apply directives one at a time, in the tracker's order (a DROP frees the slot a
        LOAD after it needs), and never two batches at once."""
        async with self.applying:
            for directive in directives:
                await self.apply(directive)

    async def apply(self, directive: Directive) -> None:
        kind = directive.type
        try:
            if kind in ("LOAD_SHARD", "DROP_SHARD") and (directive.model is None or directive.layers is None):
                status, error = "failed", f"{kind} without a model and layer range"
            elif kind == "LOAD_SHARD":
                report = await self.load(directive.model, directive.layers, directive.tier or "bootstrap")
                status, error = ("done", None) if report.passed else ("failed", report.reason)
            elif kind == "DROP_SHARD":
                dropped = self.node.runtime.drop(directive.model, directive.layers)
                if dropped is not None:  # its report goes with it (the slot key holds the canonical name)
                    self.node.reports.pop(dropped.key, None)
                status, error = "done", None
            elif kind in ("RUN_DOCTOR", "RELOAD"):
                status, error = await self.redo(kind)
            else:
                status, error = "failed", f"unknown directive type {kind}"
        except Exception as exc:  # noqa: BLE001 - report every failure to the tracker
            log.exception("directive %s failed", directive.id)
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        self.updates.append(DirectiveUpdate(id=directive.id, status=status, error=error))
        self.wake.set()

    async def redo(self, kind: str) -> tuple[str, str | None]:
        """RUN_DOCTOR re-checks every slot; RELOAD re-reads every slot's weights, then doctors."""
        rt = self.node.runtime
        for key, slot in list(rt.slots.items()):
            if kind == "RELOAD":
                self.node.reports.pop(key, None)
                rt.drop(slot.model, slot.layers)
                await self.load(slot.model, slot.layers, slot.tier)
            else:
                self.node.reports[key] = await asyncio.to_thread(run_doctor, slot, lock=rt.lock)
        failed = [r.reason for r in self.node.reports.values() if r and not r.passed]
        return ("failed", "; ".join(failed)) if failed else ("done", None)

    def _ok(self) -> None:
        self.last_ok_s, self.last_error = asyncio.get_running_loop().time(), None

    def heartbeat_age_s(self) -> float | None:
        """Seconds since the tracker last accepted a registration or heartbeat (None: never)."""
        return None if self.last_ok_s is None else asyncio.get_running_loop().time() - self.last_ok_s

    # ---- drain (ADR-0032) -------------------------------------------------------------

    async def announce_drain(self) -> None:
        """Tell the tracker at once that this node drains (no new routes or entry choices)."""
        await self.client.announce_drain(self.settings.node_id)
        log.info("told %s that %s is draining", self.client.url, self.settings.node_id)

    async def leave(self) -> None:
        """Stop heartbeating and deregister (end of a drain)."""
        self.leaving = True
        await self.client.deregister(self.settings.node_id)
        log.info("deregistered %s from %s", self.settings.node_id, self.client.url)

    # ---- used by the orchestrator -----------------------------------------------------

    async def route(self, model: str, layers: LayerRange, exclude: frozenset[str]) -> list[Hop]:
        """Hops over ``layers`` of ``model`` without ``exclude`` (no ticket: readiness checks)."""
        return await self.client.route(model, layers.start, layers.end - 1, exclude)

    async def session_route(self, model: str, layers: LayerRange, exclude: frozenset[str], session_id: str,
                            like: str | None = None) -> Route:
        """Hops over ``layers`` of ``model`` for ``session_id``, with its ticket (ADR-0038).

        Raises:
            MeshnetError: see :meth:`TrackerClient.session_route`.
        """
        return await self.client.session_route(model, layers.start, layers.end - 1, session_id, exclude, like)

    async def report_audit(self, node_id: str, report: AuditReport) -> dict:
        """Send the tracker an audit's dispute over ``node_id`` (ADR-0067); its verdict.

        Raises:
            MeshnetError: the tracker refused it or could not be reached.
        """
        return await self.client.report_audit(node_id, report)

    async def report_failure(self, node_id: str, reason: str, ticket: str | None = None) -> None:
        """Report a hop failure to the tracker with the ticket that named the hop; a lost report is logged."""
        try:
            await self.client.report_failure(node_id, reason, ticket)
        except MeshnetError as exc:
            log.warning("could not report failure of %s: %s", node_id, exc.message)
