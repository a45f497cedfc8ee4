"""Operator actions of the console: pin, doctor, reload, drain.

Each runs in a worker: ask (pin form), confirm in a modal (y / n / esc), call the tracker
through :class:`meshnet.client.TrackerClient`, report the result in a toast (doctor: in a
report modal) and wake the poller. Errors become toasts, never crashes. Under
``--readonly`` none of this is reachable: the app registers no binding for it, offers no
palette entry, and :meth:`MeshnetConsole.check_action` refuses it.

The target is the node selected in the nodes view (the first node when none is).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from typing import Any

from textual import work
from textual.app import SystemCommand

from meshnet.errors import MeshnetError
from tui.modals.confirm import ConfirmModal
from tui.modals.pin import PinModal
from tui.modals.report import ReportModal

MUTATING_ACTIONS = frozenset({"pin", "doctor", "reload", "drain"})


class OperatorActions:
    """Mixin of :class:`tui.app.MeshnetConsole` holding the mutating actions."""

    def operator_commands(self) -> Iterable[SystemCommand]:
        """Command palette entries, one per action (never offered under ``--readonly``)."""
        yield SystemCommand("Pin model to node", "Pin a model and shard range to the selected node (P)",
                            self.action_pin)
        yield SystemCommand("Doctor node", "Run doctor on the selected node and show its report (D)",
                            self.action_doctor)
        yield SystemCommand("Reload node", "Reload the selected node's shards (R)", self.action_reload)
        yield SystemCommand("Drain node", "Stop routing to the selected node (X)", self.action_drain)

    def _target(self) -> str | None:
        if self.readonly:
            return None
        node_id = self.target_node_id()
        if node_id is None:
            self.notify("no node to act on: the tracker has no registered node", severity="warning")
        return node_id

    async def _confirmed_target(self, question: str, detail: str) -> str | None:
        """The selected node id once the operator confirms ``question`` (``{node}`` filled in), else None."""
        node_id = self._target()
        if node_id is None or not await self.push_screen_wait(ConfirmModal(question.format(node=node_id), detail)):
            return None
        return node_id

    async def _operate(self, what: str, call: Awaitable[Any]) -> Any | None:
        """Await a tracker call; a failure is a toast and ``None``. Always wakes the poller."""
        try:
            return await call
        except MeshnetError as exc:
            hint = f"\n{exc.hint}" if exc.hint else ""
            self.notify(f"{exc.message}{hint}", title=f"{what} failed", severity="error", timeout=10)
            return None
        finally:
            self.wake()

    @work(group="operator", exclusive=True, exit_on_error=False)
    async def action_pin(self) -> None:
        """P: ask for a model and shard range, confirm, pin it to the selected node."""
        node_id = self._target()
        if node_id is None:
            return
        models = self.state.models()
        if not models:
            self.notify("the tracker knows no model yet", severity="warning")
            return
        node = self.state.node(node_id) or {}
        held = next((s["model"] for s in node.get("shards", [])), models[0])
        layers = {m: self.state.num_layers(m) or 0 for m in models}
        choice = await self.push_screen_wait(PinModal(node_id, models, layers, default_model=held))
        if choice is None:
            return
        model, shard = choice
        what = f"{model} layers {shard}" if shard else f"{model} (the tracker picks the layers)"
        if not await self.push_screen_wait(ConfirmModal(f"Pin {what} to {node_id}?",
                                                        "The node drops an unpinned shard if it has no free slot "
                                                        "and loads this one as tier pinned.")):
            return
        result = await self._operate("pin", self.client.pin(model, node_id, shard))
        if result:
            p = result["pinned"]
            self.notify(f"{p['model']} {p['shard_start']}-{p['shard_end']} pinned to {p['node_id']}; "
                        f"{len(result.get('directives', []))} directive(s) queued", title="pin")

    @work(group="operator", exclusive=True, exit_on_error=False)
    async def action_doctor(self) -> None:
        """D: confirm, run doctor on the selected node now, show the reports."""
        node_id = await self._confirmed_target("Run doctor on {node}?", "A real forward pass on each shard; the "
                                               "tracker re-admits or drops the node by the result.")
        if node_id is None:
            return
        self.notify(f"doctor running on {node_id}…", title="doctor")
        result = await self._operate("doctor", self.client.doctor_wait(node_id))
        if result is not None:
            self.push_screen(ReportModal(result.get("node_id", node_id), result.get("reports", []),
                                         now=self.now()))

    @work(group="operator", exclusive=True, exit_on_error=False)
    async def action_reload(self) -> None:
        """R: confirm, queue a RELOAD for the selected node."""
        node_id = await self._confirmed_target("Reload {node}?", "Its reports go stale until the next passing "
                                               "doctor; it is not routed until then.")
        if node_id is None:
            return
        result = await self._operate("reload", self.client.reload(node_id))
        if result:
            self.notify(f"RELOAD #{result['directive']['id']} queued for {node_id}", title="reload")

    @work(group="operator", exclusive=True, exit_on_error=False)
    async def action_drain(self) -> None:
        """X: confirm, drain the selected node (no new routes, no new placement)."""
        node_id = await self._confirmed_target("Drain {node}?", "It stops counting toward coverage and gets no "
                                               "new placement; the tracker re-covers its layers elsewhere.")
        if node_id is None:
            return
        result = await self._operate("drain", self.client.drain(node_id))
        if result:
            self.notify(f"{node_id} is draining", title="drain")
