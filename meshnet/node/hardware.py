"""Hardware detection for capability reports: device, memory (bytes), cores."""

from __future__ import annotations

import os
import platform

import psutil

from meshnet.protocol.control import HardwareInfo


def detect(device: str = "cpu") -> HardwareInfo:
    """Memory (bytes) and cores of this machine, and the device a node computes on: ``cpu``, or
    ``cuda:N:<GPU name>`` with ``vram_bytes`` that GPU's free memory now
    (:func:`meshnet.models.devices.device_memory_bytes`); ``vram_bytes`` is 0 on the CPU, whatever
    GPUs the machine has (a node on the CPU offers RAM)."""
    vram_bytes = 0
    from meshnet.models.devices import is_gpu

    if is_gpu(device):
        try:
            import torch

            from meshnet.models.devices import device_memory_bytes

            props = torch.cuda.get_device_properties(torch.device(device))
            device, vram_bytes = f"{device}:{props.name}", device_memory_bytes(device) or 0
        except Exception:  # noqa: BLE001 - detection must never fail a node
            pass
    return HardwareInfo(device=device, ram_bytes=int(psutil.virtual_memory().total), vram_bytes=vram_bytes,
                        cpu_count=os.cpu_count() or 1, platform=platform.platform())


def node_memory_bytes(memory_bytes: int | None, info: HardwareInfo | None = None) -> int:
    """The memory a node offers, bytes: ``--memory`` when given, else the free memory of the GPU it
    computes on, else RAM.

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
