"""Run a service app under uvicorn so that SIGTERM (or Ctrl-C) drains it before it stops.

uvicorn's own shutdown stops accepting connections at once and cancels whatever is still
running after ``timeout_graceful_shutdown``: a middle node would refuse the next hop call of
a generation in flight and a stream would be cut without a word. So the first signal starts
the app's :class:`meshnet.drain.Drain` instead, with the server still accepting (hop calls of
existing sessions go on); only when the drain has finished does uvicorn shut down, by which
time nothing of value is open. A second signal skips the rest of the drain; a third (Ctrl-C)
forces the exit. After a drain the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from meshnet.drain import Drain

log = logging.getLogger(__name__)

#: what uvicorn still gives open connections once the drain is over (health polls, idle hops), s
AFTER_DRAIN_S = 3.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal runs ``drain`` and exits when it is done."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._signalled = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """Signal handler (main thread): first signal drains, later ones fall back to uvicorn's."""
        if self.drain is None or self._loop is None or not self.started or self._signalled:
            super().handle_exit(sig, frame)
            return
        self._signalled = True
        log.info("signal %d: draining before exit (send it again to skip the drain)", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
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
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=AFTER_DRAIN_S)
    DrainingServer(config, drain).run()
