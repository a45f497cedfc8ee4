"""Hardware detection for capability reports: device, memory (bytes), cores."""

from __future__ import annotations

import os
import platform

import psutil

from meshnet.protocol.control import HardwareInfo


def detect() -> HardwareInfo:
    """Device, memory (bytes) and cores of this machine; ``vram_bytes`` is 0 without an accelerator."""
    device, vram_bytes = "cpu", 0
    try:
        import torch
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            device, vram_bytes = f"cuda:{props.name}", int(props.total_memory)
    except Exception:  # noqa: BLE001 - detection must never fail a node
        pass
    return HardwareInfo(device=device, ram_bytes=int(psutil.virtual_memory().total), vram_bytes=vram_bytes,
                        cpu_count=os.cpu_count() or 1, platform=platform.platform())


def node_memory_bytes(memory_bytes: int | None, info: HardwareInfo | None = None) -> int:
    """The memory a node offers, bytes: ``--memory`` when given, else accelerator memory, else RAM.

    This is the raw figure registered as ``vram_bytes``; the tracker's placement budgets 80 % of
    it (``meshnet.tracker.placement.memory_budget_bytes``, ADR-0003).
    """
    if memory_bytes is not None:
        return int(memory_bytes)
    info = info or detect()
    return info.vram_bytes or info.ram_bytes


def rss_bytes() -> int:
    """Resident set size of this process, bytes."""
    return int(psutil.Process().memory_info().rss)
