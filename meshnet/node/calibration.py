"""Host-measured defaults: the compute dtype and torch threads a node runs with (ADR-0044).

Which dtype decodes faster depends on the host (bfloat16 halves the bytes read per token but
needs fast bf16 kernels; on some CPUs float32 wins at batch 1), on how many sessions a node
batches (on an AVX2 CPU without native bfloat16, bfloat16 wins alone and loses by more in a
batch of 8) and on how many threads there are, so it is measured, not assumed. :func:`measure`
times single-token decode steps, on fresh KV caches, of a small sample of the model's own
layers (the step doctor times, :func:`meshnet.node.doctor.measure_decode_tokens_per_s`), for
each candidate dtype, thread count and session count (:data:`SESSIONS`), interleaved over a few
rounds (medians: these machines are noisy). :func:`choose` is the decision, a pure function
over those samples; flags the operator gave fix their axis and are never overridden.
:func:`calibrate` ties the two together and keeps the samples in ``<cache>/calibration.json``
(keyed by CPU, torch version, weight layouts, model and candidates, for :data:`CACHE_TTL_S`),
so a host measures once, not at every start: nodes that start together wait for the first one's
measurement and read it (:func:`meshnet.models.hosttimings.remembered`).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
#: bfloat16 is chosen only when it decodes at least this many times as fast as float32: float32
#: gives exact greedy output (bfloat16 drifts from it within a few tokens), so a tie goes to it
BF16_MIN_GAIN = 1.10
#: the fewest threads that reach this share of the fastest thread count's speed are chosen:
#: a thread that does not speed a decode step up only takes a core from another process
THREAD_TOLERANCE = 0.95
#: a cached measurement is trusted this long, seconds (a week)
CACHE_TTL_S = 7 * 86_400.0
#: fewest decoder layers the measurement runs (a middle sample: no embeddings, no LM head); more
#: where that is needed to read the weights from memory (:func:`sample_layer_count`)
SAMPLE_LAYERS = 2
#: sessions decoded together in the measurement: a lone session, and a batch of 8 as a busy node
#: runs them (ADR-0052; the same two counts the weight layouts are timed at, ADR-0048)
SESSIONS = (1, 8)


@dataclass(frozen=True)
class Sample:
    """Measured decode speed of the sample layers: ``tokens_per_s`` of ``sessions`` sessions
    together, decoding in ``dtype`` with ``threads``."""

    dtype: str
    threads: int
    tokens_per_s: float
    sessions: int = 1


@dataclass(frozen=True)
class Choice:
    """What a node runs with: ``compute_dtype``, ``threads`` (torch intra-op), and ``reason``, one
    line for the log and the operator."""

    compute_dtype: str
    threads: int
    reason: str


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_budget(cores: int, processes: int) -> int:
    """torch threads each of ``processes`` layer-serving processes on ``cores`` cores may use.

    The cores are split evenly (``cores // processes``, at least 1), so together they never ask
    for more threads than there are cores while ``processes <= cores``; past that each gets one
    (callers that must not oversubscribe start fewer processes, :func:`max_processes`).
    """
    return max(1, cores // max(1, processes))


def max_processes(cores: int, wanted: int) -> int:
    """How many layer-serving processes with one thread or more fit ``cores`` cores: at most
    ``wanted``, at least 1."""
    return max(1, min(wanted, cores))


def thread_candidates(budget: int) -> list[int]:
    """Thread counts worth measuring up to ``budget``: powers of two and ``budget`` itself
    (``thread_candidates(6) == [1, 2, 4, 6]``)."""
    counts, t = {max(1, budget)}, 1
    while t < budget:
        counts.add(t)
        t *= 2
    return sorted(counts)


def choose(samples: Iterable[Sample], *, dtype: str | None = None, threads: int | None = None,
           min_gain: float = BF16_MIN_GAIN, tolerance: float = THREAD_TOLERANCE) -> Choice:
    """The compute dtype and thread count to run with, from measured ``samples``.

    ``dtype`` / ``threads`` given (operator flags) are kept as they are; only samples that
    match them count. Of the rest, each dtype's *worst slowdown* is the most times slower its
    best thread count is than the other dtype's, over the session counts measured (a lone
    session, a batch: the rule ADR-0048 uses for weight layouts). bfloat16 is chosen when
    float32's worst slowdown is at least ``min_gain`` times bfloat16's (else float32, which is
    exact). Then the fewest threads within ``tolerance`` of that dtype's best speed at every
    session count.

    Raises:
        ValueError: no sample matches the fixed ``dtype``/``threads``.
    """
    usable = [s for s in samples if (dtype is None or s.dtype == dtype) and (threads is None or s.threads == threads)
              and s.tokens_per_s > 0]
    if not usable:
        raise ValueError(f"no decode measurement for dtype {dtype or 'any'} and threads {threads or 'any'}")
    dtypes, counts = {s.dtype for s in usable}, sorted({s.sessions for s in usable})
    best = {(d, n): max((s.tokens_per_s for s in usable if (s.dtype, s.sessions) == (d, n)), default=0.0)
            for d in dtypes for n in counts}
    worst = {d: max(max(best[e, n] for e in dtypes) / best[d, n] if best[d, n] else float("inf") for n in counts)
             for d in dtypes}
    speeds = ", ".join(f"{d} " + " / ".join(f"{best[d, n]:.0f}" for n in counts) for d in sorted(dtypes))
    measured = f"tokens/s at {' / '.join(map(str, counts))} session(s): {speeds}"
    if dtype is not None:
        chosen, why = dtype, f"{dtype} as given"
    elif "bfloat16" in dtypes and ("float32" not in dtypes or worst["float32"] >= min_gain * worst["bfloat16"]):
        chosen = "bfloat16"
        why = (f"{measured}; float32's worst slowdown {worst['float32']:.2f}x" if "float32" in dtypes
               else "bfloat16, the only dtype measured")
    else:
        chosen = "float32"
        why = (f"{measured}; bfloat16's worst slowdown {worst['bfloat16']:.2f}x (float32's must reach "
               f"{min_gain:.2f}x bfloat16's for it to win over exact float32)"
               if "bfloat16" in dtypes else "float32, the only dtype measured")
    mine = [s for s in usable if s.dtype == chosen]

    def share(t: int) -> float:  # the least share of the best speed that ``t`` threads reach at any session count
        return min(s.tokens_per_s / best[chosen, s.sessions] for s in mine if s.threads == t)

    within = [t for t in {s.threads for s in mine} if share(t) >= tolerance]
    if within:
        count = min(within)
        how_many = "as given" if threads is not None else f"the fewest within {tolerance:.0%} of the fastest count"
    else:  # a noisy host: no count is near the best at every session count; the one that loses least
        count = max(sorted({s.threads for s in mine}), key=share)
        how_many = f"none within {tolerance:.0%} of the fastest at every session count: the one losing least"
    return Choice(chosen, count, f"{why}; {count} thread(s), {how_many}")


def sample_layers(config: dict):
    """The decoder layers :func:`measure` times (a :class:`~meshnet.layers.LayerRange`): the
    :func:`sample_layer_count` layers after the first (from 0 in a model of few layers)."""
    from meshnet.layers import LayerRange

    num_layers = int(config.get("num_hidden_layers") or config.get("n_layer"))
    start = 1 if num_layers > SAMPLE_LAYERS else 0
    return LayerRange(start, min(num_layers, start + sample_layer_count(config)))


def measure(model_path: Path, dtypes: Sequence[str], thread_counts: Sequence[int], *, rounds: int = 3,
            steps: int = 8, sessions: Sequence[int] = SESSIONS) -> list[Sample]:
    """Decode tokens/s of :func:`sample_layer_count` middle layers of the model at ``model_path``, for each
    dtype, thread count and session count: the median of ``rounds`` interleaved runs of ``steps``
    decode steps. torch's thread count is restored afterwards.

    Raises:
        ModelSourceError: the weights cannot be read.
    """
    import torch

    from meshnet.models.shard import ShardModel
    from meshnet.node.doctor import measure_decode_tokens_per_s

    layers = sample_layers(json.loads((Path(model_path) / "config.json").read_text()))
    previous = torch.get_num_threads()
    runs: dict[tuple[str, int, int], list[float]] = {}
    try:
        torch.set_num_threads(thread_counts[0])  # the shards' host timings (layouts, attention) at a candidate count
        shards = {d: ShardModel(model_path, layers, dtype=d, load_head=False) for d in dtypes}
        for _ in range(rounds):
            for t in thread_counts:
                torch.set_num_threads(t)
                for d in dtypes:
                    for n in sessions:
                        runs.setdefault((d, t, n), []).append(measure_decode_tokens_per_s(shards[d], steps, n))
    finally:
        torch.set_num_threads(previous)
    return [Sample(d, t, round(statistics.median(v), 2), n) for (d, t, n), v in runs.items()]


def sample_layer_count(config: dict) -> int:
    """Decoder layers to measure: enough that their bfloat16 weights exceed
    :func:`meshnet.models.linears.stream_bytes` (twice the largest CPU cache), so every step reads
    them from memory as a node's shard does, at least :data:`SAMPLE_LAYERS`. A sample that fits
    in cache hides what a batch costs (a batch read from cache runs as fast in bfloat16 as in
    float32 where a real shard read from memory does not; ADR-0044). A layer's size is its
    family's count (:func:`layer_weights`); a config no family serves gets :data:`SAMPLE_LAYERS`.
    """
    from meshnet.models.linears import stream_bytes

    layer_bytes = 2 * layer_weights(config)  # bfloat16
    if layer_bytes <= 0:
        return SAMPLE_LAYERS
    return max(SAMPLE_LAYERS, -(-stream_bytes() // layer_bytes))


def layer_weights(config: dict) -> int:
    """Parameters of one decoder layer (its mean over a hybrid's layer kinds), from a
    ``config.json`` read as a dict: the family's own count
    (:func:`meshnet.models.catalog.layer_parameters`, one layer built on the meta device), so
    attention, experts, linear-attention and norms all count whatever the family; 0 where no
    certified family serves the config."""
    from meshnet.errors import MeshnetError
    from meshnet.models.catalog import layer_parameters

    settings = dict(config)
    try:
        from transformers import AutoConfig

        return layer_parameters(AutoConfig.for_model(settings.pop("model_type"), **settings)).total
    except (MeshnetError, KeyError, TypeError, ValueError):
        return 0


def host_key(model: str, dtypes: Sequence[str], thread_counts: Sequence[int]) -> str:
    """Cache key of a measurement, under the CPU and torch version that
    :func:`meshnet.models.hosttimings.remembered` adds: the model, the candidates measured, the
    session counts (:data:`SESSIONS`) and the weight layouts a shard may choose from (ADR-0048:
    a new layout changes what each dtype costs, so a measurement made without it is not reused)."""
    import torch

    from meshnet.models.linears import available_layouts

    layouts = ";".join(f"{d}:{','.join(available_layouts(getattr(torch, d)))}" for d in dtypes)
    return (f"calibration|{model}|{','.join(dtypes)}|{','.join(map(str, thread_counts))}|"
            f"sessions {','.join(map(str, SESSIONS))}|layouts {layouts}")


def default_cache_file() -> Path:
    """Where :func:`calibrate` keeps its measurements: ``<cache>/calibration.json``."""
    from meshnet.models.sources import cache_dir

    return cache_dir() / "calibration.json"


def calibrate(model: str, budget: int, *, dtype: str | None = None, threads: int | None = None,
              cache_file: Path | None = None, now: float | None = None) -> Choice:
    """The compute dtype and threads for a node serving ``model`` with at most ``budget`` threads.

    Both given: no measurement. Otherwise the free axes are measured (:func:`measure`, or the
    cached samples of this host in ``cache_file``, default ``<cache>/calibration.json``) and
    :func:`choose` decides. A model that cannot be read falls back to bfloat16 (ADR-0006) with
    ``budget`` threads, saying so in the reason.
    """
    from meshnet.errors import MeshnetError
    from meshnet.models.hosttimings import remembered
    from meshnet.models.sources import fetch_config, resolve

    if dtype is not None and threads is not None:
        return Choice(dtype, threads, "dtype and threads as given")
    dtypes = [dtype] if dtype is not None else list(DTYPES)
    counts = [threads] if threads is not None else thread_candidates(budget)
    try:  # a hub model: its config first, then only the files of the layers timed
        path = fetch_config(model, progress=lambda _msg: None)
        layers = sample_layers(json.loads((path / "config.json").read_text()))
        path = resolve(model, progress=lambda _msg: None, layers=layers, entry=False)
    except MeshnetError as exc:
        return Choice(dtype or "bfloat16", threads or budget, f"not measured ({exc.message}); ADR-0006 defaults")
    stored, measured_now = remembered(host_key(model, dtypes, counts),
                                      lambda: [asdict(s) for s in measure(path, dtypes, counts)],
                                      path=cache_file or default_cache_file(), now=now, ttl_s=CACHE_TTL_S,
                                      valid=lambda kept: samples_of(kept) is not None)
    samples = samples_of(stored) or []
    source = "measured now" if measured_now else "cached measurement"
    choice = choose(samples, dtype=dtype, threads=threads)
    log.info("compute defaults for %s (%s): %s", model, source, choice.reason)
    return Choice(choice.compute_dtype, choice.threads, f"{choice.reason} ({source})")


def samples_of(kept: object) -> list[Sample] | None:
    """The :class:`Sample` list a calibration kept (a JSON list of their fields), or None where
    it is not one: a hand-edited or damaged entry, which is then measured again."""
    if not isinstance(kept, list) or not kept:
        return None
    try:
        samples = [Sample(**s) for s in kept]
    except TypeError:  # not a mapping, or missing or unknown fields
        return None
    ok = all(isinstance(s.dtype, str) and type(s.threads) is int and type(s.sessions) is int
             and isinstance(s.tokens_per_s, (int, float)) and not isinstance(s.tokens_per_s, bool) for s in samples)
    return samples if ok else None

