"""Split parity: a model split into shards computes what the whole model computes.

For each split (a list of layer boundaries), every range is its own :class:`ShardModel` with its
own KV cache; a prompt is prefilled in chunks and then decoded token by token across the
shards, with the activations passed as they are (float32). The logits at every position are
compared with the unsplit transformers model's, run in the same steps with its own cache (the
same matrix shapes: one long product rounds otherwise than several short ones), the shards in
transformers' weight layout (a layout chosen for this host's speed, ADR-0048, rounds otherwise
too: by about 1e-4 on SmolLM2's logits of 20 to 30, whatever the split), and each decoded token with the whole model's
greedy choice wherever its top two logits differ by more than the tolerance (a near tie may
go either way on other kernels). ``meshnet models certify`` runs it on any model the user has;
``tests/unit/test_families.py`` runs it on every family's tiny seeded model.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from meshnet.errors import ModelSourceError
from meshnet.layers import LayerRange

#: largest absolute logit difference, float32, that still counts as equal (issue 25)
TOLERANCE = 1e-4


@dataclass(frozen=True)
class SplitResult:
    """One split's verdict: its ``boundaries`` (the first layer of every shard after the first),
    the largest absolute logit difference over all positions, and how many of the decoded tokens
    were decided (top-two margin over the tolerance) and matched the whole model's."""

    boundaries: tuple[int, ...]
    max_abs_diff: float
    tokens_decided: int
    tokens_matched: int

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= TOLERANCE and self.tokens_matched == self.tokens_decided


def default_splits(num_layers: int) -> list[tuple[int, ...]]:
    """Every boundary into two shards, and three-shard splits at the thirds and beside them."""
    splits: list[tuple[int, ...]] = [(b,) for b in range(1, num_layers)]
    third = max(1, num_layers // 3)
    for a, b in ((third, 2 * third), (1, num_layers - 1), (third - 1, third + 1), (num_layers // 2, num_layers - 1)):
        if 0 < a < b < num_layers:
            splits.append((a, b))
    return list(dict.fromkeys(splits))


def check_family(model_path: Path, expected: str | None) -> str:
    """The family of the model at ``model_path`` (from its ``config.json``).

    Raises:
        ModelSourceError: an unsupported ``model_type``, or a family other than ``expected`` (the
            preset's ``family``).
    """
    from meshnet.models.families import family_of, load_config

    family = family_of(load_config(model_path)).name
    if expected and family != expected:
        raise ModelSourceError(f"{model_path}/config.json is a {family} model, its preset says {expected}",
                               hint="fix the preset's family in model_presets.toml, or the model's config.json")
    return family


def certify(model_path: Path, *, splits: Iterable[tuple[int, ...]] | None = None, prompt_tokens: int = 300,
            decode_tokens: int = 40, chunk_tokens: int = 128, seed: int = 0, device: str = "cpu",
            progress: Callable[[int, int], None] | None = None) -> list[SplitResult]:
    """Split parity of the model at ``model_path`` (float32), one result per split.

    Args:
        splits: boundaries of each split (default :func:`default_splits`).
        prompt_tokens: random prompt ids (seeded); ``decode_tokens``: greedy tokens after it.
        chunk_tokens: prefill chunk; ``progress``: told ``(splits done, splits)``.
        device: where the whole model and the shards run (``cpu``, ``cuda:N``), both on the same one.

    Raises:
        ModelSourceError: the model cannot be loaded, or a boundary is outside its layers.
    """
    from meshnet.models.checkpoints import whole_model
    from meshnet.models.families import load_config
    from meshnet.models.shard import ShardModel

    num_layers = int(load_config(model_path).num_hidden_layers)
    splits = list(splits or default_splits(num_layers))
    for boundaries in splits:  # checked before anything is loaded
        edges = [0, *boundaries, num_layers]
        if any(b <= a for a, b in zip(edges, edges[1:])):
            raise ModelSourceError(f"split {tuple(boundaries)} is not inside the model's {num_layers} layers",
                                   hint=f"boundaries are increasing layer numbers between 1 and {num_layers - 1}")
    whole = whole_model(model_path, torch.float32).to(device)
    vocab = int(whole.config.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (1, prompt_tokens), generator=generator).to(device)
    config = copy.deepcopy(whole.generation_config)
    config.eos_token_id, config.min_new_tokens = None, None  # all tokens greedy: no end, no end suppressed
    config.max_new_tokens, config.do_sample, config.pad_token_id = decode_tokens, False, 0
    with torch.inference_mode():
        ids = whole.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
        reference = _whole_logits(whole, ids, prompt_tokens, chunk_tokens).cpu()
        ids = ids.cpu()
    del whole
    results = []
    for done, boundaries in enumerate(splits):
        edges = [0, *boundaries, num_layers]
        # each split loads its own shards (kept for every split, the copies would add up to the
        # model's size times the number of splits)
        with _row_layout():
            chain = [ShardModel(model_path, LayerRange(a, b), dtype="float32", load_head=a == 0, device=device)
                     for a, b in zip(edges, edges[1:])]
        logits = _split_logits(chain, ids[0].tolist(), prompt_tokens, chunk_tokens)
        results.append(_compare(tuple(boundaries), logits, reference, ids[0].tolist(), prompt_tokens))
        if progress is not None:
            progress(done + 1, len(splits))
    return results


@contextlib.contextmanager
def _row_layout():
    """Shards loaded in the block keep transformers' own weight layout: a layout a host chose for
    speed (ADR-0048) rounds its products otherwise (by about 1e-4 on SmolLM2's logits), which is no
    matter of the split. The choice is forgotten before and after, so nothing else sees it."""
    from meshnet.models.linears import LAYOUT_ENV, layout

    before = os.environ.get(LAYOUT_ENV)
    os.environ[LAYOUT_ENV] = "row"
    layout.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAYOUT_ENV, None)
        else:
            os.environ[LAYOUT_ENV] = before
        layout.cache_clear()


def _steps(length: int, decode_from: int, chunk: int) -> list[tuple[int, int]]:
    """``(position, tokens)`` of each step: prefill chunks of ``chunk`` up to ``decode_from``, then one a step."""
    return [(p, min(chunk, decode_from - p)) for p in range(0, decode_from, chunk)] + \
        [(p, 1) for p in range(decode_from, length)]


def _whole_logits(whole, ids: torch.Tensor, decode_from: int, chunk: int) -> torch.Tensor:
    """Logits ``[len, vocab]`` (float32) of ``ids`` ``[1, len]`` through the whole transformers
    model with its own KV cache, in the steps the split runs (:func:`_steps`): the same matrix
    shapes at every layer, so a difference is the split's, not a longer product's rounding."""
    cache, out = None, []  # the model makes the cache its family needs (a hybrid's holds recurrent states)
    for position, count in _steps(ids.shape[1], decode_from, chunk):
        step = whole(ids[:, position:position + count], past_key_values=cache, use_cache=True)
        cache = step.past_key_values
        out.append(step.logits[0].float())
    return torch.cat(out)


def _split_logits(chain: list, ids: list[int], decode_from: int, chunk: int) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` of ``ids`` through the shards of ``chain``, each with its own
    cache: chunked prefill up to ``decode_from``, then one token per step."""
    from meshnet.models.caches import KVCache

    caches = [KVCache() for _ in chain]
    out = []
    for position, count in _steps(len(ids), decode_from, chunk):
        tokens = ids[position:position + count]
        hidden = chain[0].embed_tokens(torch.tensor([tokens]), position)
        for shard, cache in zip(chain, caches):
            hidden = shard.forward(hidden, cache, position)
        out.append(chain[0].logits(hidden)[0])
    return torch.cat(out)


def _compare(boundaries: tuple[int, ...], logits: torch.Tensor, reference: torch.Tensor, ids: list[int],
             decode_from: int) -> SplitResult:
    diff = float((logits - reference).abs().max())
    decided = matched = 0
    for p in range(decode_from - 1, len(ids) - 1):  # the logits at p choose token p + 1
        top2 = torch.topk(reference[p], 2).values
        if float(top2[0] - top2[1]) > TOLERANCE:
            decided += 1
            matched += int(int(torch.argmax(logits[p])) == ids[p + 1])
    return SplitResult(boundaries, diff, decided, matched)
