"""Measured throughput (ADR-0068): a node's claimed speed is held against the tracker's own probe.

Routes rank a model's holders by tokens/s (ADR-0004), a figure each node reports about itself (its
heartbeat's decode EMA, its doctor run): a node that claimed 5,000 tokens/s drew every chat. The
tracker now times each admitted shard itself. A **speed probe** opens a fresh session on the shard
under a tracker ticket, sends one token of random hidden states at position 0 and then one decode
step at position 1, and times that second call (:func:`probe_tokens_per_s`). A node can make a
probe slower, never faster, so ``1 / seconds`` bounds what it can do from above.

A probe also carries the call's own cost (HTTP, the ticket check, the round trip), which is most of
it for a small shard on a fast host, so a claim is never compared with its probe alone. Each probed
holder's **inflation** is its claim over its probe; the model's **baseline** is the lower median of
its probed holders' inflations (honest holders of one network pay the same call costs, so their
inflations sit together; the lower median of two is the more modest one, and one holder claiming
less than its probes, as a busy node's decode average can, does not set the bar). A holder whose
inflation exceeds :data:`CLAIM_FACTOR` times the baseline **loses its claim**: routes count it at
``probe x baseline``, what a typical holder would claim at that probe. Holders within the factor
keep their claims exactly, so an honest network's routes do not move with the probes' noise.

Probes run only for shards that share a layer with another admitted holder's (a lone holder of
its layers has no rival to draw traffic from), at most :data:`MAX_PROBES_PER_ROUND` each
control-loop second (the registry is scanned for due shards every :data:`SCAN_EVERY_S` seconds
while none wait), each shard again every ``TrackerSettings.speed_probe_interval_s`` (0: never); a
probe that fails records nothing.
Each tracker probes for itself (the figures are not shared through the database: a successor
probes again within one interval).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Hashable, Mapping

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.dataplane.evidence import challenge_frame
from meshnet.tracker.admission import Holder, run_steps

__all__ = ["CLAIM_FACTOR", "MAX_PROBES_PER_ROUND", "PROBE_SAMPLES", "judge_claims", "probe_tokens_per_s"]

#: a holder may claim this many times the baseline inflation before it loses its claim: honest
#: SmolLM2 holders of this host measured within 3.1x of each other (0.43-1.32, ADR-0068); a claim of
#: ten times the truth measured 7x the baseline and is caught
CLAIM_FACTOR = 4.0
#: probes remembered per shard; the best of them counts (a probe that queued behind a chat is slow)
PROBE_SAMPLES = 3
#: speed probes the tracker starts per control-loop round (one a second)
MAX_PROBES_PER_ROUND = 4
#: seconds between two scans of the registry for due probes once a scan found fewer than the round's
#: cap (a newly admitted shard waits at most this long for its first probe)
SCAN_EVERY_S = 5.0


def judge_claims(holders: Mapping[Hashable, tuple[float, float | None]]) -> dict[Hashable, float]:
    """The tokens/s routes count for each holder of one model: its claim, or ``probe x baseline``
    when the claim is over :data:`CLAIM_FACTOR` times the baseline inflation (see the module).

    Args:
        holders: key (a holder: node and shard) -> ``(claimed tokens/s, probed tokens/s or None)``;
            a holder not probed yet, or with no positive figures, keeps its claim.

    Returns:
        key -> tokens/s; only the keys whose claim was lost differ from their claim (none while
        fewer than two holders are probed).
    """
    inflation = {key: claimed / probed for key, (claimed, probed) in holders.items()
                 if probed is not None and probed > 0 and claimed > 0}
    out = {key: claimed for key, (claimed, _) in holders.items()}
    if len(inflation) < 2:
        return out
    ratios = sorted(inflation.values())
    baseline = ratios[(len(ratios) - 1) // 2]  # the lower median
    for key, ratio in inflation.items():
        if ratio > CLAIM_FACTOR * baseline:
            out[key] = holders[key][1] * baseline
    return out


async def probe_tokens_per_s(http: httpx.AsyncClient, key: Ed25519PrivateKey, holder: Holder, model: str,
                             hidden_size: int, timeout_s: float) -> float:
    """Time one decode step through ``holder``'s shard: a fresh session (tracker ticket), one token
    of random hidden states ``[1, 1, hidden_size]`` float32 at position 0, then one at position 1,
    timed (seconds of the second call, request to response); the session is released after.

    Returns:
        ``1 / seconds``: tokens/s through the shard's layers, call costs included.

    Raises:
        Any failure of a call (refused, timed out, an error status), as :func:`run_steps`.
    """
    seed = secrets.randbits(62)
    steps = [(position, challenge_frame(seed + position, 1, hidden_size), False) for position in (0, 1)]
    times: list[float] = []
    await run_steps(http, key, holder, model, holder.layers, steps, timeout_s, times=times)
    return 1.0 / max(times[-1], 1e-6)


def due(probed_at: float | None, interval_s: float, now: float | None = None) -> bool:
    """Whether a shard last probed at monotonic ``probed_at`` (None: never) is due again."""
    if interval_s <= 0:
        return False
    return probed_at is None or (time.monotonic() if now is None else now) - probed_at >= interval_s
