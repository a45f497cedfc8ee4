"""Load a shard into a node for real: resolve weights (a hub model: only the files its layers
need), fill a slot, run doctor."""

from __future__ import annotations

import asyncio
import logging

from meshnet.layers import LayerRange
from meshnet.node.doctor import run_doctor
from meshnet.protocol.control import CapabilityReport

log = logging.getLogger(__name__)


async def load_shard(node, model: str, layers: LayerRange, tier: str) -> CapabilityReport:
    """Resolve ``model``'s weights, load ``layers`` into a free slot of ``node`` (a NodeContext),
    run doctor on it and store the capability report. Returns the report.

    Raises:
        MeshnetError: weights unavailable, or no free slot.
    """
    from meshnet.models.sources import resolve

    path = await asyncio.to_thread(resolve, model, layers=layers)  # a hub model: only these layers' files
    slot = await asyncio.to_thread(node.runtime.load, model, path, layers,
                                   quantization=node.settings.quantization, tier=tier)
    report = await asyncio.to_thread(run_doctor, slot, lock=node.runtime.lock)
    node.reports[slot.key] = report
    if not report.passed:
        log.warning("doctor failed for %s %s: %s", model, layers, report.reason)
    return report
