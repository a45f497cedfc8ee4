"""The tracker serving the first layers: one process, the tracker app and a node app side by side
(US-014, ADR-0044).

The composition, and nothing else: the tracker app answers at the root as always, the node app
is mounted at :data:`NODE_PREFIX` (``/node``), so the two keep their own ``/v1/health``,
``/v1/ready``, ``/v1/chat/completions``, ``/v1/models`` and ``/metrics`` without a clash. The
node is a node like any other: its endpoint is ``<tracker URL>/node``, it has its own key, it
registers with this very tracker over HTTP, heartbeats, is probed, doctored, placed and shown
like the rest. What the process adds is the short path: the tracker's chat endpoint hands a
chat of a model whose first layers the local node serves (admitted) to that node's app
in-process (:class:`meshnet.tracker.proxy.LocalChat`), so there is no proxy hop.

Lifecycle: the tracker starts with the app (it must answer before its node can register); the
node's own lifespan (load the shard, doctor, register, heartbeat) runs in a background task once
the server listens. SIGTERM drains both at once (:class:`meshnet.drain.DrainGroup`): the node
announces its drain to the tracker, finishes its sessions and deregisters while the tracker lets
its chats finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
from starlette.applications import Starlette
from starlette.routing import Mount

from meshnet.drain import DrainGroup
from meshnet.endpoints import base_url
from meshnet.node.app import build_app as build_node_app
from meshnet.node.settings import NodeSettings
from meshnet.tracker.app import build_app as build_tracker_app
from meshnet.tracker.proxy import LocalNode
from meshnet.tracker.service import TrackerService, TrackerSettings

log = logging.getLogger(__name__)

#: where the tracker's own node answers, below the tracker's URL
NODE_PREFIX = "/node"
#: how long a node still starting (loading its shard, registering) may take to stop, seconds
NODE_STOP_S = 10.0

__all__ = ["NODE_PREFIX", "build_app", "local_tracker_url", "node_endpoint"]


def local_tracker_url(host: str, port: int) -> str:
    """The URL this process reaches its own tracker at: ``host:port``, a wildcard address
    (``0.0.0.0``, ``::``, empty) replaced by the loopback address of its family."""
    loopback = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "[::]": "::1"}
    return base_url(loopback.get(host, host), port)


def node_endpoint(tracker_url: str) -> str:
    """The endpoint the tracker's own node advertises: the tracker's URL plus :data:`NODE_PREFIX`."""
    return tracker_url.rstrip("/") + NODE_PREFIX


def build_app(tracker: TrackerSettings, node: NodeSettings, *, service: TrackerService | None = None,
              run_loop: bool = True, transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The app of a tracker that also serves layers: the tracker at ``/``, the node at ``/node``.

    ``node`` must name this tracker as its ``tracker_url`` and advertise an endpoint ending in
    :data:`NODE_PREFIX` on it (:func:`node_endpoint`); it keeps its own key, join token and
    settings. ``transport`` carries the outbound calls of both (tests; default the network).
    ``app.state.drain`` drains both (:class:`meshnet.drain.DrainGroup`); ``app.state.node_app``
    and ``app.state.tracker_app`` are the two apps. Why the node failed to start, if it did, is
    in the tracker's ``GET /v1/health`` (``local_node.error``).

    Raises:
        ValueError: the node has no tracker URL or its endpoint is not below :data:`NODE_PREFIX`.
        MeshnetError: see :func:`meshnet.tracker.app.build_app` (an exposed tracker without tokens).
    """
    if not node.tracker_url:
        raise ValueError("the tracker's own node needs the tracker's URL (tracker_url)")
    if not node.endpoint.endswith(NODE_PREFIX):
        raise ValueError(f"the tracker's own node must advertise an endpoint ending in {NODE_PREFIX}, "
                         f"not {node.endpoint}")
    node_app = build_node_app(node, transport=transport)
    tracker_app = build_tracker_app(tracker, service, run_loop=run_loop, transport=transport,
                                    local_node=LocalNode(node.node_id, node_app))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with tracker_app.router.lifespan_context(tracker_app):
            stop = asyncio.Event()
            task = asyncio.create_task(_run_node(tracker_app, node_app, stop))
            try:
                yield
            finally:
                stop.set()
                try:
                    async with asyncio.timeout(NODE_STOP_S):  # not wait_for: it can swallow a cancel on 3.11
                        await asyncio.shield(task)
                except asyncio.TimeoutError:  # still loading or registering: stop it now
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    app = Starlette(routes=[Mount(NODE_PREFIX, app=node_app), Mount("", app=tracker_app)], lifespan=lifespan)
    app.state.drain = DrainGroup(tracker_app.state.drain, node_app.state.drain)
    app.state.node_app, app.state.tracker_app = node_app, tracker_app
    return app


async def _run_node(tracker_app: Starlette, node_app: Starlette, stop: asyncio.Event) -> None:
    """Run the node's lifespan until ``stop``; a node that fails to start leaves the tracker up,
    with the reason in the log and in ``tracker_app.state.local_node_error`` (its health shows it)."""
    try:
        async with node_app.router.lifespan_context(node_app):
            log.info("the tracker's own node %s is up", node_app.state.node.settings.node_id)
            await stop.wait()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tracker goes on without its node
        tracker_app.state.local_node_error = f"{type(exc).__name__}: {exc}"
        log.exception("the tracker's own node failed to start; the tracker runs on without it")
