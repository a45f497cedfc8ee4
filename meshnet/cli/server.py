"""Run a service app under uvicorn so that SIGTERM (or Ctrl-C) drains it before it stops.

uvicorn's own shutdown stops accepting connections at once and cancels whatever is still
running after ``timeout_graceful_shutdown``: a middle node would refuse the next hop call of
a generation in flight and a stream would be cut without a word. So the first signal starts
the app's :class:`meshnet.drain.Drain` instead, with the server still accepting (hop calls of
existing sessions go on); only when the drain has finished does uvicorn shut down, by which
time nothing of value is open. A second signal cuts what is still open (streams end with an
error event) and stops at once, exiting by that signal; a third (Ctrl-C) forces the exit.
After a drain the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from meshnet.drain import Drain
from meshnet.relay.frames import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

#: what uvicorn still gives open connections once the drain is over (health polls, idle hops), s
AFTER_DRAIN_S = 3.0
#: keepalive pings on served WebSockets (relay tunnels, hop streams): a peer silent for about
#: interval + timeout is dropped, so a relay forgets a tunnel whose network vanished (ADR-0045), s
WS_PING_INTERVAL_S = 5.0
WS_PING_TIMEOUT_S = 5.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal runs ``drain`` and exits when it is done."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._signalled = False

    async def startup(self, sockets=None) -> None:
        # not in an override of serve(): that frame would be resumed on every tick of uvicorn's loop
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self._signalled and not self.should_exit:  # signalled while starting: drain now
            self._start_drain()

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        log.info("server closed")

    def handle_exit(self, sig: int, frame) -> None:
        """Signal handler (main thread): the first signal drains (once started: a node registers
        while it starts, so it must still deregister); later ones fall back to uvicorn's."""
        if self.drain is None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        if self._signalled:  # again: cut what is open (error events) and let uvicorn stop now
            log.warning("signal %d again: cutting %d request(s) in flight", sig, self.drain.in_flight)
            self._loop.call_soon_threadsafe(self.drain.cut.set)
            super().handle_exit(sig, frame)
            return
        self._signalled = True
        log.info("signal %d: draining before exit (send it again to skip the drain)", sig)
        if self.started:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        except Exception:  # noqa: BLE001 - whatever happens, the process must still exit
            log.exception("drain failed; exiting anyway")
        finally:
            self.should_exit = True


def serve(app, host: str, port: int, drain: Drain | None = None) -> None:
    """Serve ``app`` on ``host:port`` until a signal; with ``drain``, SIGTERM/SIGINT drain first.

    Blocks. Returns after the server has shut down.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=AFTER_DRAIN_S,
                            ws_ping_interval=WS_PING_INTERVAL_S, ws_ping_timeout=WS_PING_TIMEOUT_S,
                            ws_max_size=MAX_FRAME_BYTES)  # a relay tunnel's largest message (ADR-0045)
    DrainingServer(config, drain).run()
