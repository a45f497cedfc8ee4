"""Builders of control-plane payloads for tests, in the exact shape nodes send
(:mod:`meshnet.protocol.control`): a test that drifts from the protocol fails validation."""

from __future__ import annotations

import time


def capability_report(model: str, start: int, end: int, *, passed: bool = True, tokens_per_s: float = 100.0,
                      timestamp: float | None = None, reason: str | None = None) -> dict:
    """A doctor report for ``model`` layers ``start..end`` (inclusive), passed or failed."""
    return {"model": model, "shard_start": start, "shard_end": end,
            "recipe": {"quantization": "bfloat16", "compute_dtype": "float32"},
            "hardware": {"device": "cpu", "ram_bytes": 8 * 1024**3, "vram_bytes": 0, "cpu_count": 4, "platform": "test"},
            "weights_digest": "", "tokens_per_s": tokens_per_s if passed else 0.0, "passed": passed,
            "reason": reason or ("forward pass finite and well-shaped" if passed else "probe output has NaN"),
            "timestamp": time.time() if timestamp is None else timestamp}
