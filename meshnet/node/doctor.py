"""``doctor``: prove with a real forward pass that a shard works, and measure it.

The probe is fixed: an entry shard embeds token ids ``arange(16) * 7 % vocab``; any other
shard gets seeded standard-normal hidden states ``[1, 16, hidden]`` (seed 0). The check:
the output has the input's shape and is finite, and for the ``int8``/``int4``/``nf4`` recipes its
relative L2 error against the same shard loaded unquantized in float32 is within
``TOLERANCE``. Then 8 single-token decode steps on a
fresh KV cache measure tokens/s for the shard. The report also carries the shard's resident
memory measured when it was loaded (ADR-0039). The result is a **capability report**;
the tracker routes a shard only while its report is present, passed and fresh.
"""

from __future__ import annotations

import hashlib
import time

import torch

from meshnet.models.caches import KVCache
from meshnet.node import hardware
from meshnet.protocol.control import CapabilityReport

PROBE_TOKENS = 16
DECODE_STEPS = 8
#: max relative L2 error of a quantized shard's probe output against the same shard in
#: float32 on the same weights. Measured on SmolLM2 10-layer shards: int8 0.025-0.073,
#: int4 0.018-0.040 (group-wise, ADR-0062), nf4 0.29-0.54 (random probes amplify 4-bit error);
#: wrong weights give about 1.0-1.4.
TOLERANCE = {"int8": 0.15, "int4": 0.15, "nf4": 0.75}


def weights_digest(shard) -> str:
    """blake2b (16-byte) digest over the shard's parameter names, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name, module in sorted(shard._modules().items()):
        if module is None:
            continue
        for pname, p in sorted(module.state_dict().items()):
            h.update(f"{name}.{pname}:{tuple(p.shape)}".encode())
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@torch.inference_mode()
def _probe(shard) -> torch.Tensor:
    if shard.is_entry:
        ids = (torch.arange(PROBE_TOKENS) * 7 % shard.config.vocab_size)[None]
        hidden = shard.embed_tokens(ids, 0)
    else:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, PROBE_TOKENS, shard.config.hidden_size, generator=gen)
    return shard.forward(hidden, KVCache(), 0)


@torch.inference_mode()
def measure_decode_tokens_per_s(shard, steps: int = DECODE_STEPS, sessions: int = 1) -> float:
    """Decode tokens per second of ``shard`` (a ShardModel), all sessions together: ``steps``
    single-token steps of ``sessions`` sessions, each on a fresh KV cache, after one warm-up step,
    with seeded standard-normal hidden states ``[1, 1, hidden]`` per session. One session runs
    :meth:`ShardModel.forward`; several run one :meth:`ShardModel.forward_batch` per step, as a
    node batches them (ADR-0052)."""
    caches = [KVCache() for _ in range(sessions)]
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(sessions, 1, shard.config.hidden_size, generator=gen)
    for row, cache in enumerate(caches):  # warm-up: every cache holds one position
        shard.forward(hidden[row:row + 1], cache, 0)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        if sessions == 1:
            shard.forward(hidden, caches[0], step)
        else:
            shard.forward_batch(hidden, caches, [step] * sessions)
    return sessions * steps / (time.perf_counter() - t0)


def _within_tolerance(slot, out: torch.Tensor, report: dict) -> bool:
    """Quantized recipes only: compare with the unquantized shard; records the error in ``report``."""
    """Quantized recipes only: compare with the unquantized shard (loaded transiently)."""
    if slot.quantization not in TOLERANCE:
        return True
    from meshnet.models.shard import ShardModel

    shard = slot.shard
    reference = _probe(ShardModel(shard.model_path, slot.layers, dtype="float32", load_head=shard.is_entry,
                                  device=str(shard.device)))
    error = float((out.float() - reference).norm() / reference.norm().clamp_min(1e-12))
    report["reference_rel_error"] = round(error, 4)
    report["tolerance"] = TOLERANCE[slot.quantization]
    return error <= TOLERANCE[slot.quantization]


def run_doctor(slot, *, lock=None) -> CapabilityReport:
    """Capability report of one shard slot (see :class:`meshnet.protocol.control.CapabilityReport`).

    Never raises: a probe that fails or raises gives a report with ``passed`` False and the reason.
    """
    shard = slot.shard
    start, end = slot.layers.to_inclusive()
    report = {"model": slot.model, "shard_start": start, "shard_end": end,
              "recipe": {"quantization": slot.quantization, "compute_dtype": str(shard.dtype).split(".")[-1]},
              "hardware": hardware.detect(str(shard.device)).model_dump(), "weights_digest": "", "tokens_per_s": 0.0,
              "passed": False, "reason": "", "timestamp": time.time(),
              "resident_bytes": slot.resident_bytes or None}
    try:
        if lock is not None:
            lock.acquire()
        try:
            out = _probe(shard)
            if tuple(out.shape) != (1, PROBE_TOKENS, shard.config.hidden_size):
                report["reason"] = f"probe output shape {list(out.shape)} is wrong"
            elif not bool(torch.isfinite(out).all()):
                report["reason"] = "probe output has NaN or infinite values"
            elif not _within_tolerance(slot, out, report):
                report["reason"] = (f"{slot.quantization} probe differs from float32 by "
                                    f"{report['reference_rel_error']:.3f} > {TOLERANCE[slot.quantization]}")
            else:
                report["tokens_per_s"] = round(measure_decode_tokens_per_s(shard), 2)
                report["passed"] = True
                report["reason"] = "forward pass finite and well-shaped"
            report["weights_digest"] = weights_digest(shard)
        finally:
            if lock is not None:
                lock.release()
    except Exception as exc:  # noqa: BLE001 - any failure is a failed report, never a crash
        report["reason"] = f"probe raised {type(exc).__name__}: {exc}"
    report["timestamp"] = time.time()
    return CapabilityReport.model_validate(report)


def run_doctor_all(node) -> list[CapabilityReport]:
    """Run doctor on every slot of ``node`` (a NodeContext); stores and returns the reports."""
    reports = []
    for key, slot in list(node.runtime.slots.items()):
        report = run_doctor(slot, lock=node.runtime.lock)
        node.reports[key] = report
        reports.append(report)
    return reports
