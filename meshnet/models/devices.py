"""Where a shard runs: the CPU or one CUDA GPU (``--device auto|cpu|cuda|cuda:N``).

On a GPU a shard's weights, KV cache and linear-attention states live in device memory; the
wire moves activations to and from host memory once per step (:class:`ShardModel` returns
host tensors). The memory a GPU node offers is the device's free memory when it starts
(``torch.cuda.mem_get_info``); the tracker budgets a share of it for weights and leaves the
rest for KV caches (ADR-0003). A GPU computes in bfloat16 where it has bfloat16 arithmetic,
else float16 (:func:`gpu_dtype`); a CPU's dtype is measured (ADR-0044).
"""

from __future__ import annotations

from meshnet.errors import MeshnetError

__all__ = ["DEVICE_CHOICES", "device_memory_bytes", "gpu_dtype", "is_gpu", "resolve_device"]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(spec: str | None) -> str:
    """The torch device a ``--device`` value names: ``auto`` (or None) is ``cuda:0`` where CUDA is
    present, else ``cpu``; ``cuda`` is ``cuda:0``.

    Raises:
        MeshnetError: an unknown value, CUDA asked for on a machine without it, or a GPU index
            the machine does not have (code ``bad_device``; the message names the flag).
    """
    import torch

    spec = (spec or "auto").strip().lower()
    available = torch.cuda.is_available()
    if spec == "auto":
        return "cuda:0" if available else "cpu"
    if spec == "cpu":
        return "cpu"
    if spec == "cuda" or spec.startswith("cuda:"):
        index = spec.partition(":")[2] or "0"
        if not index.isdigit():
            raise MeshnetError(f"--device {spec!r} is not a device", code="bad_device",
                               hint=f"use {DEVICE_CHOICES}")
        if not available:
            raise MeshnetError(f"--device {spec}: this machine has no CUDA GPU that torch can use", code="bad_device",
                               hint="use --device cpu (or auto), or install a CUDA build of torch")
        if int(index) >= torch.cuda.device_count():
            raise MeshnetError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA GPU(s)",
                               code="bad_device", hint=f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        return f"cuda:{int(index)}"
    raise MeshnetError(f"--device {spec!r} is not a device", code="bad_device", hint=f"use {DEVICE_CHOICES}")


def is_gpu(device: str) -> bool:
    """Whether ``device`` (a :func:`resolve_device` result) is a CUDA GPU."""
    return device.startswith("cuda")


def device_memory_bytes(device: str) -> int | None:
    """Free memory of GPU ``device`` now, bytes (``torch.cuda.mem_get_info``); None for the CPU
    (its memory is the host's RAM, :func:`meshnet.node.hardware.detect`)."""
    if not is_gpu(device):
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def gpu_dtype(device: str) -> str:
    """The compute dtype of GPU ``device``: ``bfloat16`` where it computes in it (compute
    capability 8.0 on: Ampere, Hopper), else ``float16``."""
    import torch

    with torch.cuda.device(torch.device(device)):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
