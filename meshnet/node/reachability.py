"""Whether the tracker reaches this node, and the relay it moves to when not (ADR-0045).

Part of :class:`meshnet.node.agent.TrackerAgent`. The tracker's probe verdict arrives with each
registration and heartbeat; an unreachable node allowed a relay waits until its own listener
answers and the tracker still cannot reach it, then attaches a tunnel
(:class:`meshnet.relay.tunnel.NodeTunnel`) and registers the relayed endpoint. A node relayed
through another node that stays down moves to the tracker's relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from meshnet.endpoints import check_endpoints
from meshnet.errors import MeshnetError
from meshnet.protocol.control import HeartbeatResponse, RegisterResponse
from meshnet.protocol.waits import wait_event
from meshnet.relay.tunnel import NodeTunnel

log = logging.getLogger(__name__)

#: an unreachable node moves to a relay when the tracker still cannot reach it this long after the
#: node's own listener answered: longer than a probe's timeout plus its retry interval, seconds
AUTO_RELAY_AFTER_S = 5.0
#: a node relayed through another node (``--relay-url``) whose tunnel stays down this long moves
#: to the tracker's relay, seconds
RELAY_FALLBACK_S = 30.0
#: a node relayed through a tracker that stopped answering (its calls moved to another of its
#: trackers) whose tunnel stays down this long moves to the relay of the tracker that answers,
#: seconds. The tunnel drops at a missed keepalive (``PING_INTERVAL_S`` + ``PING_TIMEOUT_S`` of
#: :mod:`meshnet.relay.tunnel`, 6 s); a tunnel that is down while the calls go elsewhere is not
#: waited for long (a tunnel still up is kept: both trackers answering 503 during a database outage
#: must not make it flip between them)
TRACKER_RELAY_FALLBACK_S = 1.0


class RelayMixin:
    """The reachability and relay side of :class:`TrackerAgent` (which provides ``settings``,
    ``client``, ``key``, ``endpoint``, ``registration``, ``note_registered``, ``wake``,
    ``wake_soon`` and the tunnel state ``tunnel``, ``_tunnel_task``, ``_considering``,
    ``_listening_since``, ``reachable`` and ``_probed_again``)."""

    def note_reachability(self, resp: RegisterResponse | HeartbeatResponse) -> None:
        """Log when the tracker's verdict on reaching this node's endpoint changes: an unreachable
        node's shards are not admitted, so nothing is routed to it (meshnet.tracker.probe). An
        unreachable node allowed a relay considers moving to one (:meth:`consider_relay`)."""
        reachable = resp.reachable
        if not reachable and self.tunnel is None and self.settings.auto_relay:
            self.consider_relay()
        if reachable == self.reachable:
            return
        if not reachable and self.reachable is None and not self._probed_again:
            # a node registers before it listens: the tracker probes again within a second, so
            # the first "unreachable" is only provisional; the next verdict decides
            self._probed_again = True
            log.info("registered before listening; the tracker will probe %s again", self.endpoint)
            self.wake_soon(1.5)
            return
        self.reachable = reachable
        if reachable:
            log.info("the tracker reaches this node at %s; its shards can be admitted", self.endpoint)
        elif self.tunnel is None and self.settings.auto_relay:
            log.info("the tracker cannot reach this node at %s (%s); if it still cannot once this node "
                     "listens, the node serves through a relay", self.endpoint, resp.reach_error)
        elif self.tunnel is None:
            log.warning("the tracker cannot reach this node at %s (%s): its shards are not admitted until it "
                        "can; check --public-url, --host and firewalls (or allow a relay)", self.endpoint,
                        resp.reach_error)
        else:
            log.warning("the tracker cannot reach this node through its relay at %s (%s); the tunnel dials "
                        "again by itself", self.endpoint, resp.reach_error)

    def consider_relay(self) -> None:
        """Move to a relay when the tracker still cannot reach this node :data:`AUTO_RELAY_AFTER_S`
        after the node's own listener answered (an earlier verdict may predate the listener)."""
        if self._considering is None or self._considering.done():
            self._considering = asyncio.create_task(self._consider_relay())

    async def _consider_relay(self) -> None:
        loop = asyncio.get_running_loop()
        if not await self._listening():
            self._listening_since = None
            return
        if self._listening_since is None:
            self._listening_since = loop.time()
            self.wake_soon(AUTO_RELAY_AFTER_S + 0.1)  # a verdict from a probe made after it listens
            return
        if loop.time() - self._listening_since < AUTO_RELAY_AFTER_S or self.tunnel is not None:
            return
        log.warning("the tracker cannot reach this node at %s although it listens: serving through a relay "
                    "instead", self.endpoint)
        await self.switch_to_relay()

    async def _listening(self) -> bool:
        """Whether this node's own listener answers ``GET /v1/health`` on ``local_url``."""
        try:
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
                return (await http.get(f"{self.settings.local_url}/v1/health")).status_code < 500
        except httpx.HTTPError:
            return False

    def _new_tunnel(self, relay_url: str | None = None) -> NodeTunnel:
        """The relay tunnel (to ``relay_url``, else ``--relay-url``, else the tracker), not dialling
        yet: its endpoint is known before the first attach, so the node can register it first (an
        attach needs a node id the relay knows)."""
        relay_url = relay_url or self.settings.relay_url or self.tracker_now()
        return NodeTunnel(relay_url, self.settings.node_id, self.key, self.settings.local_url,
                          on_attached=self._tunnel_attached)

    async def start_tunnel(self, attach_wait_s: float = 10.0) -> None:
        """Dial the tunnel (made by :meth:`_new_tunnel` when none is) and wait up to ``attach_wait_s``
        for the first attach; the node goes on either way (the tunnel keeps dialling)."""
        if self.tunnel is None:
            self.tunnel = self._new_tunnel()
        if self._tunnel_task is None:
            self._tunnel_task = asyncio.create_task(self.tunnel.run())
        if not await wait_event(self.tunnel.attached, attach_wait_s):
            log.warning("no tunnel to %s within %.0f s (%s); still trying", self.tunnel.relay_url, attach_wait_s,
                        self.tunnel.last_error)

    def tracker_urls(self) -> list[str]:
        """Every tracker this node was given (``--tracker A,B``), in order (its client's list)."""
        client = getattr(self, "client", None)
        if client is not None:
            return client.urls
        return check_endpoints(self.settings.tracker_url) if self.settings.tracker_url else []

    def tracker_now(self) -> str | None:
        """The tracker this node's calls go to now: the one that answered last (the agent's client
        moves on from one that does not answer, ADR-0054), else the first given; None standalone."""
        client = getattr(self, "client", None)
        if client is not None:
            return client.url
        urls = self.tracker_urls()
        return urls[0] if urls else None

    def relay_lost(self) -> bool:
        """Whether this node's relay is gone and the relay of the tracker that answers now should
        take over: a relay node (``--relay-url``) whose tunnel has been down
        :data:`RELAY_FALLBACK_S`, or another of the node's trackers (one that stopped answering)
        down :data:`TRACKER_RELAY_FALLBACK_S`."""
        tunnel, tracker = self.tunnel, self.tracker_now()
        if tunnel is None or not tracker or tunnel.relay_url == tracker:
            return False
        wait_s = TRACKER_RELAY_FALLBACK_S if tunnel.relay_url in self.tracker_urls() else RELAY_FALLBACK_S
        return tunnel.down_for_s() >= wait_s

    async def fall_back_to_tracker_relay(self) -> None:
        """The relay of this node is gone: attach to the relay of the tracker that answers now and
        register that endpoint."""
        old, tracker = self.tunnel, self.tracker_now()
        log.warning("relay %s unreachable for %.0f s (%s): moving to the relay of %s", old.relay_url,
                    old.down_for_s(), old.last_error, tracker)
        if self._tunnel_task is not None:
            self._tunnel_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tunnel_task
        self.tunnel, self._tunnel_task = self._new_tunnel(tracker), None
        await self.switch_to_relay()

    async def switch_to_relay(self) -> None:
        """The tracker cannot reach this node: attach a tunnel, then register the relayed endpoint."""
        await self.start_tunnel()
        self.reachable, self._probed_again = None, False
        try:
            self.note_registered(await self.client.register(self.registration()))
        except MeshnetError as exc:  # the next heartbeat's 404 or the next round registers again
            self.last_error = exc.message
            log.warning("registration through the relay failed: %s", exc.message)

    def _tunnel_attached(self) -> None:
        """A tunnel (re)attached: heartbeat now, so the tracker hears of the node at once."""
        if self.tunnel is not None and self.tunnel.attaches > 1:
            self.wake.set()
