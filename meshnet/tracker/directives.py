"""Operator decisions and the directives they queue (part of :class:`meshnet.tracker.service.TrackerService`).

Pins are operator intent kept in the store (restored when a node comes back); reload, drain and
doctor results change a node's admission; every directive is queued in the store and delivered
with the node's next heartbeat. The HTTP handlers only validate and call these.
"""

from __future__ import annotations

import logging

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from meshnet.tracker import placement
from meshnet.protocol.control import OPEN_STATUSES, CapabilityReport, Directive
from meshnet.tracker.registry import ModelInfo, NodeRecord

log = logging.getLogger(__name__)


class DirectivesMixin:
    """Pins, reloads, drains and the directive queue of :class:`TrackerService` (which provides
    ``store``, ``get``, ``save``, ``ensure_model``, ``admitted_shards``, ``verify_shards``,
    ``queued_hint`` and ``dirty``)."""

    def queue_directive(self, node_id: str, type_: str, *, model: str | None = None,
                        layers: LayerRange | None = None, tier: str | None = None, reason: str = "") -> Directive:
        """Queue one directive for ``node_id`` (delivered with its next heartbeat); returns its row."""
        start, end = layers.to_inclusive() if layers is not None else (None, None)
        directive = self.store.add_directive(node_id, type_, model=model, shard_start=start, shard_end=end, tier=tier,
                                             reason=reason)
        self.note_queued([node_id])
        return directive

    def restore_pins(self, node: NodeRecord, pins: list[dict] | None = None) -> list[Directive]:
        """Give a (re)registering node back every shard the operator pinned on it.

        A pin is operator intent kept in the store: a node that comes back without its pinned
        shard (a restart with no shard flags, or after a tracker restart) gets a ``LOAD_SHARD``
        with tier ``pinned``, unless it already holds that range or such a load is still open.
        ``pins``: the node's pins as just read from the store (None: read them here). Returns the
        directives queued.
        """
        pins = self.store.pins(node.node_id) if pins is None else pins
        if not pins:  # the usual case: one read
            return []
        held = {(s.model, s.layers) for s in node.shards}
        open_loads = {(d.model, d.shard_start, d.shard_end)
                      for d in self.store.directives(node_id=node.node_id, statuses=OPEN_STATUSES)
                      if d.type == "LOAD_SHARD"}
        queued = []
        for pin in pins:
            layers = LayerRange.from_inclusive(pin["shard_start"], pin["shard_end"])
            if (pin["model"], layers) in held or (pin["model"], pin["shard_start"], pin["shard_end"]) in open_loads:
                continue
            self.ensure_model(pin["model"])
            queued.append(self.queue_directive(node.node_id, "LOAD_SHARD", model=pin["model"], layers=layers,
                                               tier="pinned", reason="operator pin (restored)"))
            log.info("restoring pin %s %s on %s", pin["model"], layers, node.node_id)
        return queued

    def pin(self, node_id: str, model: str, layers: LayerRange | None = None) -> tuple[dict, list[Directive]]:
        """Pin ``model`` (``layers``, or the range placement would give the node) on ``node_id``.

        The pin is stored (it survives node and tracker restarts, see :meth:`restore_pins`); the
        node gets a ``LOAD_SHARD`` with tier ``pinned``, preceded by a ``DROP_SHARD`` of a
        non-pinned shard when all its slots are full (managed shards go first).

        Returns:
            ``(pin {node_id, model, shard_start, shard_end}, directives queued)``.

        Raises:
            NotFound: unknown node or model. InvalidRequest (422): ``layers`` beyond the model.
        """
        node = self.get(node_id)
        info = self.ensure_model(model)
        if layers is None:
            layers, _ = self.suggest_range(info, node.vram_bytes, node.quantization)
        elif layers.end > info.num_layers:
            start, end = layers.to_inclusive()
            raise InvalidRequest(f"shard {start}-{end} beyond {info.name}'s {info.num_layers} layers",
                                 code="invalid_field", status=422)
        start, end = layers.to_inclusive()
        self.track_model(info.name)
        self.store.add_pin(node.node_id, info.name, start, end)
        queued = []
        free = node.max_loaded_shards - len(node.shards)
        for shard in sorted(node.shards, key=lambda s: s.tier != "managed"):
            if free >= 1:
                break
            if shard.tier != "pinned":
                queued.append(self.queue_directive(node.node_id, "DROP_SHARD", model=shard.model, layers=shard.layers,
                                                   tier=shard.tier, reason="operator pin"))
                free += 1
        queued.append(self.queue_directive(node.node_id, "LOAD_SHARD", model=info.name, layers=layers, tier="pinned",
                                           reason="operator pin"))
        return {"node_id": node.node_id, "model": info.name, "shard_start": start, "shard_end": end}, queued

    def suggest_range(self, info: ModelInfo, vram_bytes: int, quantization: str) -> tuple[LayerRange, bool]:
        """The range a node of ``vram_bytes`` (recipe ``quantization``) should take of ``info``'s model
        now: the first coverage gap it fits, else redundancy (ADR-0011). Returns ``(layers, gap_found)``."""
        spec = placement.ModelSpec(info.name, info.num_layers, info.bytes_per_layer)
        counts = placement.coverage_counts(info.num_layers, [s.layers for _, s in self.admitted_shards(info.name)])
        return placement.find_assignment(spec, counts, vram_bytes, quantization)

    def unpin(self, node_id: str, model: str) -> bool:
        """Forget the operator's pin of ``model`` on ``node_id``: it is no longer restored when the
        node re-registers. The shard the node holds now keeps serving until it is dropped or the
        node restarts. Returns True when a pin was removed.

        Raises:
            NotFound: unknown model.
        """
        return self.store.remove_pin(node_id, self.ensure_model(model).name)

    def reload(self, node_id: str) -> Directive:
        """Queue a ``RELOAD``; the node's current reports stop counting until a new doctor passes."""
        node = self.get(node_id)
        node.mark_reports_stale()
        self.dirty = True
        self.save(node)
        return self.queue_directive(node.node_id, "RELOAD", reason="operator reload")

    def record_doctor(self, node_id: str, reports: list[CapabilityReport]) -> list[str]:
        """Store the capability reports a doctor run on ``node_id`` returned (matched to its shards
        by model and range); returns the reasons of those that failed."""
        node = self.get(node_id)
        by_range = {(r.model, r.layers): r for r in reports}
        for shard in node.shards:
            shard.report = by_range.get((shard.model, shard.layers), shard.report)
        self.verify_shards(node)
        self.dirty = True
        self.save(node)
        return [r.reason for r in reports if not r.passed]

    def drain(self, node_id: str) -> NodeRecord:
        """Take ``node_id`` out of routes and placement (it keeps its shards and its record)."""
        node = self.get(node_id)
        node.draining = True
        self.dirty = True
        self.save(node)
        return node

    def note_queued(self, node_ids) -> None:
        """Directives were queued for ``node_ids`` by this tracker: their next heartbeat reads them."""
        node_ids = set(node_ids)
        self.queued_hint |= node_ids
        if self.store.shared:
            self._queued_since_read |= node_ids

    def take_queued_since_read(self) -> set[str]:
        """The nodes this tracker queued directives for since the last call (the sync round's read)."""
        out, self._queued_since_read = self._queued_since_read, set()
        return out
