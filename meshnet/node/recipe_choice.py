"""``--quantization auto``: the recipe a CPU node runs, measured on this host (ADR-0065).

Which recipe decodes fastest depends on the CPU: a decode step reads every weight once, so int4
(0.625 bytes a weight) and int8 (1 byte) beat bfloat16 (2 bytes) where their kernels keep up, and
float32 (4 bytes) is exact. :func:`measure` times the calibration's sample layers
(:func:`meshnet.node.calibration.sample_layers`, no embeddings or head) in each candidate recipe
at the node's thread count, a lone session and a batch of 8 interleaved over a few rounds, and
measures each quantized recipe's distance to float32 on the doctor's probe (relative L2, as the
doctor's admission check does). :func:`choose` is the decision, a pure function: recipes beyond
the doctor's tolerance are out; of the rest, a less exact recipe wins only when the more exact
one's worst slowdown is at least :data:`MIN_GAIN` times its own (the rule of the calibration's
dtype choice, ADR-0044). The samples are kept in ``<cache>/calibration.json`` like the
calibration's, so a host measures once.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: candidates on a CPU, most exact first (the order ties are broken in)
CANDIDATES = ("float32", "bfloat16", "int8", "int4")
#: a less exact recipe must decode at least this many times as fast (its worst slowdown this
#: much smaller) to be chosen over a more exact one; the calibration's ``BF16_MIN_GAIN``
MIN_GAIN = 1.10
#: sessions decoding together in the measurement (the calibration's counts)
SESSIONS = (1, 8)


@dataclass(frozen=True)
class RecipeSample:
    """Decode tokens/s of the sample layers in ``recipe`` with ``sessions`` sessions together, and
    the recipe's relative L2 distance to float32 on the doctor's probe (0.0 for float32)."""

    recipe: str
    sessions: int
    tokens_per_s: float
    distance: float = 0.0


@dataclass(frozen=True)
class RecipeChoice:
    """The recipe (``quantization``) and compute dtype a node runs, and why."""

    quantization: str
    compute_dtype: str
    reason: str


def compute_dtype(recipe: str) -> str:
    """The compute dtype of ``recipe``: float32 for ``float32``, bfloat16 for every other."""
    return "float32" if recipe == "float32" else "bfloat16"


def choose(samples: Iterable[RecipeSample], tolerance: dict[str, float] | None = None,
           min_gain: float = MIN_GAIN) -> RecipeChoice:
    """The recipe to run from measured ``samples``.

    A recipe whose distance exceeds ``tolerance`` (default the doctor's, ``doctor.TOLERANCE``;
    recipes it does not name have no limit) is out. Each remaining recipe's worst slowdown is the
    most times slower it is than the fastest recipe, over the session counts measured. Walking
    from the most exact (:data:`CANDIDATES` order), a less exact recipe replaces the one chosen so
    far when that one's worst slowdown is at least ``min_gain`` times its own.

    Raises:
        ValueError: no sample of a recipe within its tolerance.
    """
    if tolerance is None:
        from meshnet.node.doctor import TOLERANCE as tolerance
    samples = [s for s in samples if s.tokens_per_s > 0]
    far = {s.recipe for s in samples if s.distance > tolerance.get(s.recipe, float("inf"))}
    usable = [s for s in samples if s.recipe not in far]
    if not usable:
        raise ValueError("no recipe was measured within the doctor's tolerance")
    order = [r for r in CANDIDATES if any(s.recipe == r for s in usable)]
    order += sorted({s.recipe for s in usable} - set(order))
    counts = sorted({s.sessions for s in usable})
    best = {(r, n): max((s.tokens_per_s for s in usable if (s.recipe, s.sessions) == (r, n)), default=0.0)
            for r in order for n in counts}
    worst = {r: max(max(best[o, n] for o in order) / best[r, n] if best[r, n] else float("inf") for n in counts)
             for r in order}
    chosen = order[0]
    for recipe in order[1:]:
        if worst[chosen] >= min_gain * worst[recipe]:
            chosen = recipe
    speeds = "; ".join(f"{r} " + " / ".join(f"{best[r, n]:.0f}" for n in counts) for r in order)
    out = f"; beyond the doctor's tolerance: {', '.join(sorted(far))}" if far else ""
    distance = max((s.distance for s in usable if s.recipe == chosen), default=0.0)
    reason = (f"{chosen}: decode tokens/s at {' / '.join(map(str, counts))} session(s): {speeds}; worst slowdown "
              f"{worst[chosen]:.2f}x, distance to float32 {distance:.3f}{out} (a less exact recipe needs "
              f"{min_gain:.2f}x)")
    return RecipeChoice(chosen, compute_dtype(chosen), reason)


def measure(model_path: Path, recipes: Sequence[str] = CANDIDATES, *, rounds: int = 3, steps: int = 8,
            sessions: Sequence[int] = SESSIONS) -> list[RecipeSample]:
    """Decode tokens/s (median of ``rounds`` interleaved runs of ``steps`` steps) and distance to
    float32 of the calibration's sample layers of the model at ``model_path`` in each recipe, at
    torch's current thread count.

    Raises:
        ModelSourceError: the weights cannot be read.
    """
    import torch

    from meshnet.models.shard import ShardModel
    from meshnet.node.calibration import sample_layers
    from meshnet.node.doctor import _probe, measure_decode_tokens_per_s

    layers = sample_layers(json.loads((Path(model_path) / "config.json").read_text()))
    shards = {r: ShardModel(model_path, layers, dtype=compute_dtype(r), quantization=r, load_head=False)
              for r in recipes}
    reference = _probe(shards["float32"] if "float32" in shards else
                       ShardModel(model_path, layers, dtype="float32", load_head=False)).float()
    distance = {r: float((_probe(s).float() - reference).norm() / reference.norm().clamp_min(1e-12))
                for r, s in shards.items()}
    runs: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for r, shard in shards.items():
                for n in sessions:
                    runs.setdefault((r, n), []).append(measure_decode_tokens_per_s(shard, steps, n))
    return [RecipeSample(r, n, round(statistics.median(v), 2), round(0.0 if r == "float32" else distance[r], 4))
            for (r, n), v in runs.items()]


def samples_of(kept: object) -> list[RecipeSample] | None:
    """The samples a measurement kept (a JSON list of their fields), or None where it is not one."""
    if not isinstance(kept, list) or not kept:
        return None
    try:
        samples = [RecipeSample(**s) for s in kept]
    except TypeError:
        return None
    ok = all(isinstance(s.recipe, str) and type(s.sessions) is int and isinstance(s.tokens_per_s, (int, float))
             and isinstance(s.distance, (int, float)) for s in samples)
    return samples if ok else None


def choose_recipe(model: str, *, cache_file: Path | None = None) -> RecipeChoice:
    """The recipe for a CPU node serving ``model`` at torch's current thread count: measured
    (:func:`measure`) or this host's kept measurement, then :func:`choose`. A model whose sample
    layers cannot be read gets bfloat16 (ADR-0006), saying so.
    """
    import torch

    from meshnet.errors import MeshnetError
    from meshnet.models.hosttimings import remembered
    from meshnet.models.sources import fetch_config, resolve
    from meshnet.node.calibration import default_cache_file, sample_layers

    try:
        path = fetch_config(model, progress=lambda _msg: None)
        layers = sample_layers(json.loads((path / "config.json").read_text()))
        path = resolve(model, progress=lambda _msg: None, layers=layers, entry=False)
    except MeshnetError as exc:
        return RecipeChoice("bfloat16", "bfloat16", f"not measured ({exc.message}); ADR-0006 defaults")
    key = f"recipes|{model}|{','.join(CANDIDATES)}|threads {torch.get_num_threads()}|sessions 1,8"
    stored, measured_now = remembered(key, lambda: [asdict(s) for s in measure(path)],
                                      path=cache_file or default_cache_file(),
                                      valid=lambda kept: samples_of(kept) is not None)
    choice = choose(samples_of(stored) or [])
    source = "measured now" if measured_now else "cached measurement"
    log.info("recipe for %s (%s): %s", model, source, choice.reason)
    return RecipeChoice(choice.quantization, choice.compute_dtype, f"{choice.reason} ({source})")
