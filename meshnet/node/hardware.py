"""Hardware detection for capability reports: device, memory (bytes), cores."""

from __future__ import annotations

import os
import platform

import psutil


def detect() -> dict:
    """``{device, ram_bytes, vram_bytes, cpu_count, platform}``; ``vram_bytes`` is 0 without an accelerator."""
    info = {"device": "cpu", "ram_bytes": int(psutil.virtual_memory().total), "vram_bytes": 0,
            "cpu_count": os.cpu_count() or 1, "platform": platform.platform()}
    try:
        import torch
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(device=f"cuda:{props.name}", vram_bytes=int(props.total_memory))
    except Exception:  # noqa: BLE001 - detection must never fail a node
        pass
    return info


def memory_budget_bytes(memory_bytes: int | None, info: dict | None = None) -> int:
    """Effective memory budget in bytes: ``--memory`` when given, else VRAM, else system RAM."""
    if memory_bytes is not None:
        return int(memory_bytes)
    info = info or detect()
    return info["vram_bytes"] or info["ram_bytes"]


def rss_bytes() -> int:
    """Resident set size of this process, bytes."""
    return int(psutil.Process().memory_info().rss)
