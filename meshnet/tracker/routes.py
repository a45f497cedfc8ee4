"""Coverage maps, routes and session tickets over admitted shards (part of
:class:`meshnet.tracker.service.TrackerService`).

The pure decisions live in :mod:`meshnet.tracker.routing` (which hops) and
:mod:`meshnet.tracker.placement` (coverage counts); this mixin feeds them the service's records.
"""

from __future__ import annotations

import logging
import time

from meshnet.protocol.ids import NodeId, SessionId
from meshnet.errors import Forbidden, InvalidRequest, ModelNotRoutable
from meshnet.layers import LayerRange
from meshnet.presets import canonical_model_name, find_preset
from meshnet.tracker import placement, readiness, routing, speed
from meshnet.tracker.admission import Holder
from meshnet.protocol.views import Coverage, CoverageSegment
from meshnet.tracker.registry import NodeRecord, ShardRecord

log = logging.getLogger(__name__)


def may_enter(sender: NodeRecord | None, model: str) -> str:
    """Why ``sender`` may not get a session ticket for ``model`` ("" when it may): only a
    registered node holding an entry shard of the model drives its sessions."""
    if sender is None:
        return "the sender is not a registered node"
    if not any(s.entry and s.model == model for s in sender.shards):
        return f"the sender holds no entry shard of {model}"
    return ""


def _verified(shard: ShardRecord) -> bool:
    """Whether the tracker verified ``shard`` against another holder, or the operator trusts its node
    (verdict ``verified``, ADR-0069), rather than admitting it on its holder's word."""
    return shard.verdict is not None and shard.verdict.state == "verified"


class RoutesMixin:
    """Coverage, routes, entry choice, tickets and readiness of :class:`TrackerService` (which
    provides ``nodes``, ``ensure_model``, ``tracked_models``, ``tickets``, ``public_key`` and
    ``add_demand``)."""

    def admitted_by_model(self) -> dict[str, list[tuple[NodeRecord, ShardRecord]]]:
        """Every admitted shard, by model: one pass over the registry."""
        out: dict[str, list[tuple[NodeRecord, ShardRecord]]] = {}
        for node in self.nodes.values():
            for shard in node.shards:
                if node.admitted(shard):
                    out.setdefault(shard.model, []).append((node, shard))
        return out

    def admitted_shards(self, model: str) -> list[tuple[NodeRecord, ShardRecord]]:
        """Admitted shards of ``model`` (any of its names)."""
        model = canonical_model_name(model)
        return [(n, s) for n in self.nodes.values() for s in n.shards if s.model == model and n.admitted(s)]

    def routed_shards(self, model: str) -> list[tuple[NodeRecord, ShardRecord]]:
        """The admitted shards of ``model`` that coverage, routes and entry choice count: every one,
        or with ``require_verified`` only those checked against another holder or trusted by the
        operator (verdict ``verified``; ADR-0069)."""
        shards = self.admitted_shards(model)
        return [(n, s) for n, s in shards if _verified(s)] if self.settings.require_verified else shards

    def hops_verified(self, model: str, hops: list[routing.Hop]) -> bool:
        """Whether every hop runs on a shard the tracker verified (a challenge against another
        holder, or the operator's trust), not on its holder's word alone (ADR-0069)."""
        verified = {(n.node_id, s.layers) for n, s in self.admitted_shards(model) if _verified(s)}
        return all(any(node_id == h.node_id and layers.start <= h.layers.start and h.layers.end <= layers.end
                       for node_id, layers in verified) for h in hops)

    def coverage(self, model: str) -> Coverage:
        """``model``'s coverage map over its admitted shards (segments inclusive, ADR-0002).

        Raises:
            NotFound: unknown model.
        """
        info = self.ensure_model(model)
        admitted = [s for _, s in self.routed_shards(model)]
        counts = placement.coverage_counts(info.num_layers, [s.layers for s in admitted])
        segments, start = [], 0
        for layer in range(1, info.num_layers + 1):
            if layer == info.num_layers or counts[layer] != counts[start]:
                segments.append(CoverageSegment(start_layer=start, end_layer=layer - 1, node_count=counts[start]))
                start = layer
        covered = sum(1 for c in counts if c > 0)
        has_entry = any(s.entry for s in admitted)
        return Coverage(model=info.name, num_layers=info.num_layers, segments=segments, covered_layers=covered,
                        routable=covered == info.num_layers and has_entry, demand=self.demand_rate(info.name))

    def candidates(self, model: str, end_layer: int) -> list[routing.ShardCandidate]:
        """Admitted shards of ``model`` starting before ``end_layer`` (full shard ranges: the
        measured tokens/s is over the whole shard; choose_route trims past ``num_layers``).

        Load is the node's live KV-cache sessions. Per-hop network latency is not measured yet
        (nodes report compute time only, which tokens/s already counts), so it is 0 here, except
        the relay's extra leg for a relayed node (:func:`routing.relay_latency_s`, ADR-0045).
        """
        now = time.monotonic()
        out = []
        admitted = self.routed_shards(model)
        speeds = self.judged_speeds(admitted)
        for node, shard in admitted:
            if shard.layers.start >= end_layer:
                continue
            age = None if node.last_failure_s is None else now - node.last_failure_s
            out.append(routing.ShardCandidate(node.node_id, node.endpoint, shard.layers,
                                              speeds[node.node_id, shard.layers],
                                              routing.relay_latency_s(node.relay_url,
                                                                      node.stats.relay_rtt_s or node.relay_rtt_s),
                                              node.stats.sessions, age))
        return out

    @staticmethod
    def judged_speeds(admitted: list[tuple[NodeRecord, ShardRecord]]) -> dict[tuple[str, LayerRange], float]:
        """(node id, layers) -> the tokens/s routes count for each of one model's ``admitted``
        shards: its claim (:meth:`NodeRecord.tokens_per_s`), unless this tracker's speed probes
        show it inflated beyond its peers' (:func:`meshnet.tracker.speed.judge_claims`, ADR-0068)."""
        return speed.judge_claims({(node.node_id, shard.layers): (node.tokens_per_s(shard),
                                                                  node.probed_tokens_per_s(shard))
                                   for node, shard in admitted})

    def take_speed_probes(self, now: float | None = None) -> list[tuple[Holder, str, int]]:
        """The speed probes to start now (ADR-0068): ``(holder, model, hidden size)`` of admitted
        shards that share a layer with another admitted holder's shard, not probed within
        ``speed_probe_interval_s`` and not being probed, at most :data:`speed.MAX_PROBES_PER_ROUND`;
        each is marked as being probed until :meth:`record_speed_probe`."""
        interval = self.settings.speed_probe_interval_s
        now = time.monotonic() if now is None else now
        if interval <= 0 or now < self.speed_scan_at:
            return []
        # a scan reads every node of the registry: after one that found fewer than the cap, wait
        self.speed_scan_at = now + min(interval, speed.SCAN_EVERY_S)
        out = []
        for model, shards in sorted(self.admitted_by_model().items()):
            preset = find_preset(model)
            if len(shards) < 2 or preset is None:
                continue
            copies = placement.coverage_counts(max(s.layers.end for _, s in shards), [s.layers for _, s in shards])
            for node, shard in shards:
                if max(copies[shard.layers.start:shard.layers.end], default=0) < 2:
                    continue  # no other holder serves any of its layers: no rival to draw its traffic
                key = (node.node_id, model, shard.layers)
                if key in self.speed_probing or not speed.due(node.speed_probed_at.get((model, shard.layers)),
                                                               interval, now):
                    continue
                self.speed_probing.add(key)
                out.append((self._holder(node, shard), model, preset.hidden_size))
                if len(out) >= speed.MAX_PROBES_PER_ROUND:
                    self.speed_scan_at = now  # more are due: the next round goes on
                    return out
        return out

    def record_speed_probe(self, node_id: str, model: str, layers: LayerRange, tokens_per_s: float | None) -> None:
        """Keep one speed probe's answer (None: it failed; the shard is probed again after the
        interval) and log a holder whose claim its probes now refute, or restore (ADR-0068)."""
        self.speed_probing.discard((node_id, model, layers))
        node = self.nodes.get(node_id)
        if node is None:
            return
        node.speed_probed_at[model, layers] = time.monotonic()
        if tokens_per_s is None:
            return
        samples = node.speed_probes.setdefault((model, layers), [])
        samples.append(round(tokens_per_s, 3))
        del samples[:-speed.PROBE_SAMPLES]
        admitted = self.admitted_shards(model)
        judged = self.judged_speeds(admitted)
        for holder, shard in admitted:
            claimed, counted = holder.tokens_per_s(shard), judged[holder.node_id, shard.layers]
            key, lost = (model, shard.layers), counted != claimed
            was_lost = key in holder.claims_refuted
            if lost:  # routes and placement count it at its judged figure
                holder.claims_refuted[key] = counted
            else:
                holder.claims_refuted.pop(key, None)
            if lost == was_lost:
                continue
            if lost:
                log.warning("%s on %s %s claims %.1f tokens/s, its probes show %.1f: routes count %.1f "
                            "(claim set aside, ADR-0068)", holder.node_id, model, shard.layers, claimed,
                            holder.probed_tokens_per_s(shard), counted)
            else:
                log.info("%s on %s %s: its claim of %.1f tokens/s is consistent with its probes again",
                         holder.node_id, model, shard.layers, claimed)

    def recipe_of(self, node_id: str, model: str, layers: LayerRange) -> tuple[str, str] | None:
        """``(quantization, compute dtype)`` of ``node_id``'s admitted shard of ``model`` covering
        ``layers`` (None: it holds none)."""
        for n, s in self.admitted_shards(model):
            if n.node_id == node_id and s.layers.start <= layers.start and layers.end <= s.layers.end:
                return s.quantization, s.report.recipe.compute_dtype
        return None

    def route(self, model: str, layers: LayerRange, exclude: frozenset[NodeId] = frozenset(),
              like: str | None = None) -> list[routing.Hop]:
        """Hops covering exactly ``layers`` of ``model``; with ``like``, only through shards of the same
        recipe (quantization and compute dtype) as that node's over ``layers`` (ADR-0042: spot-check
        witnesses compute what the checked hop computes, so one tolerance fits).

        Raises:
            NoRoute (503 model_loading): some layer has no usable admitted shard.
        """
        info = self.ensure_model(model)
        if layers.end > info.num_layers:
            raise InvalidRequest(f"layers {layers} beyond {model}'s {info.num_layers} layers",
                                 code="invalid_field", status=422)
        try:
            candidates = self.candidates(model, layers.end)
            if like is not None:
                recipe = self.recipe_of(like, model, layers)
                same = {(n.node_id, s.layers) for n, s in self.admitted_shards(model)
                        if recipe is not None and (s.quantization, s.report.recipe.compute_dtype) == recipe}
                candidates = [c for c in candidates if (c.node_id, c.layers) in same]
            return routing.choose_route(layers.end, candidates, start_layer=layers.start, exclude=exclude)
        except routing.NoRoute as exc:
            full = routing.NoRoute(exc.gap_start, info.num_layers)
            full.coverage = self.coverage(model).model_dump()
            raise full from None

    def unverified_hops(self, model: str, hops: list[routing.Hop]) -> list[str]:
        """Node ids of ``hops`` whose layers no other admitted holder covers (nothing can
        spot-check them, ADR-0042)."""
        shards = self.admitted_shards(model)
        return [h.node_id for h in hops
                if not any(n.node_id != h.node_id and s.layers.start <= h.layers.start and h.layers.end <= s.layers.end
                           for n, s in shards)]

    def session_ticket(self, entry: NodeId, session: SessionId, model: str, hops: list[routing.Hop]) -> str:
        """A ticket for ``hops`` of ``model`` in ``session``, driven by node ``entry`` (whose signature
        the caller checked).

        Raises:
            Forbidden (403 ``not_an_entry``): ``entry`` holds no entry shard of ``model``;
                (403 ``session_taken``): another entry owns ``session``.
        """
        info = self.ensure_model(model)
        why = may_enter(self.nodes.get(entry), info.name)
        if why:
            raise Forbidden(f"{entry} may not drive sessions of {info.name}: {why}", code="not_an_entry")
        return self.tickets.issue(session=session, model=info.name, entry=entry, entry_key=self.public_key(entry) or "",
                                  hops=hops)

    def entry_nodes(self, model: str) -> list[NodeRecord]:
        """Admitted entry nodes of a routable model (so never a draining one), in the order a chat
        tries them: ones without a recent failure (hop or proxy) first, then least loaded. At
        least one.

        Raises:
            ModelNotRoutable: coverage gap or no entry node; the request counts as demand.
        """
        info = self.ensure_model(model)
        cov = self.coverage(info.name)
        entries = [(n, s) for n, s in self.routed_shards(info.name) if s.entry]
        if not cov.routable:  # routable implies an admitted entry node
            self.add_demand(info.name)
            raise ModelNotRoutable(f"model {info.name} is not routable yet: {cov.covered_layers}/{info.num_layers} "
                                   "layers covered by admitted nodes", coverage=cov.model_dump(), retry_after_s=5,
                                   hint="retry after Retry-After seconds; the tracker places shards where demand appears")
        now = time.monotonic()

        def failed_recently(n: NodeRecord) -> bool:
            return n.last_failure_s is not None and now - n.last_failure_s < routing.FAILURE_COOLDOWN_S

        ranked = sorted(entries, key=lambda e: (failed_recently(e[0]), e[0].stats.requests_running,
                                                e[0].stats.sessions, e[0].node_id))
        return list({n.node_id: n for n, _ in ranked}.values())

    def readiness(self, model: str | None = None, *, draining: bool = False) -> dict:
        """Whether a chat can be served now (of ``model``, or of any tracked model), and why not.

        Raises:
            NotFound: ``model`` is not known.
        """
        names = [self.ensure_model(model).name] if model else [m.name for m in self.tracked_models()]
        return readiness.tracker_readiness([self.coverage(n).model_dump() for n in names], draining=draining)
