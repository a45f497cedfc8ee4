"""Batch invariance (ADR-0064, meshnet.models.invariance): the rule each linear kernel needs, the
rules themselves, and a bfloat16 shard whose rows and positions give one result in any batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshnet.gateway.speculation import MAX_DRAFTS
from meshnet.layers import LayerRange
from meshnet.models import invariance
from meshnet.models.caches import KVCache
from meshnet.models.kernels import ANY_ROWS, INVARIANT_SPAN, PAD_ROWS, SPLIT_ROWS, UpcastLinear, batch_invariant


class Kernel(nn.Module):
    """A stand-in linear layer ``[..., 8] -> [..., 8]`` (times two, exact) whose result moves by
    ``drift(rows)`` with the product's row count."""

    def __init__(self, drift) -> None:
        super().__init__()
        self.in_features = self.out_features = 8
        self.weight = torch.zeros(8, 8)
        self.drift = drift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x + self.drift(x.reshape(-1, 8).shape[0])


@pytest.mark.parametrize("drift, rule", [(lambda rows: 0.0, ANY_ROWS),
                                         (lambda rows: 1e-3 if rows == 1 else 0.0, PAD_ROWS),
                                         (lambda rows: 1e-3 * (rows > 8), SPLIT_ROWS),
                                         (lambda rows: 1e-3 * rows, SPLIT_ROWS)])
def test_the_rule_is_the_cheapest_that_makes_every_row_count_agree(drift, rule):
    assert invariance.measure_rule(Kernel(drift), trials=1) == rule


@pytest.mark.parametrize("rule", [PAD_ROWS, SPLIT_ROWS])
def test_each_rule_gives_a_row_what_it_gives_it_in_a_pair(rule):
    kernel = Kernel(lambda rows: 1e-3 if rows == 1 else 0.0)
    one, many = torch.ones(1, 1, 8), torch.arange(24.0).reshape(3, 1, 8)
    assert torch.equal(batch_invariant(one, kernel, PAD_ROWS), torch.full((1, 1, 8), 2.0))
    assert torch.equal(batch_invariant(many, kernel, PAD_ROWS), 2 * many)
    if rule == SPLIT_ROWS:  # every row alone: the lone row's drift on each
        assert torch.equal(batch_invariant(many, kernel, SPLIT_ROWS), 2 * many + 1e-3)


def test_the_span_run_position_by_position_covers_every_speculative_step():
    assert INVARIANT_SPAN == MAX_DRAFTS + 1


def test_auto_leaves_float32_and_split_layers_as_they_are(monkeypatch):
    monkeypatch.setattr(invariance, "rule_for", lambda linear: SPLIT_ROWS)
    half, single = nn.Linear(8, 8, dtype=torch.bfloat16), nn.Linear(8, 8)
    half.min_rows = 4  # a host whose float32 path runs products of 4 rows or more
    assert invariance.make_batch_invariant(nn.Sequential(half, single)) == {ANY_ROWS: 1}
    assert type(half) is nn.Linear and half.min_rows == 4  # auto: split left out, the host's fast path kept
    assert type(single) is nn.Linear
    monkeypatch.setenv(invariance.ENV, "on")
    assert invariance.make_batch_invariant(nn.Sequential(half, single)) == {SPLIT_ROWS: 2}
    assert type(half) is UpcastLinear and single.rows_rule == half.rows_rule == SPLIT_ROWS
    assert half.min_rows == invariance.UPCAST_FROM
    monkeypatch.setenv(invariance.ENV, "off")
    assert not invariance.applies(torch.bfloat16)
    assert not invariance.applies(torch.float32, "int4")
    monkeypatch.setenv(invariance.ENV, "sometimes")
    with pytest.raises(ValueError, match="MESHNET_BATCH_INVARIANT must be auto, on or off, got 'sometimes'"):
        invariance.mode()


@pytest.mark.parametrize("dtype, recipe, covered", [(torch.bfloat16, "bfloat16", True),
                                                     (torch.float32, "float32", False),
                                                     (torch.float32, "int4", True), (torch.float32, "int8", True),
                                                     (torch.bfloat16, "int4", True), (torch.float32, "nf4", False)])
def test_auto_covers_the_half_dtypes_and_the_row_wise_recipes_in_any_dtype(dtype, recipe, covered):
    """An int4 or int8 shard computing in float32 (a host whose calibration picks float32) is covered
    under ``auto``: its weight kernels compute each row alone, and what is left (the attention of
    speculative spans) costs little. Left out, eight concurrent int4 chats in float32 differed from
    their solo runs (tests/integration/test_batched_decode.py)."""
    assert invariance.applies(dtype, recipe) is covered


@pytest.mark.parametrize("dtype, recipe", [("bfloat16", "bfloat16"), ("float32", "int4")])
def test_a_speculative_step_equals_its_positions_decoded_one_by_one(tiny_model_path, dtype, recipe):
    """A step of 1 + 4 positions (a token and its drafts) and the same positions decoded one by one
    give bit-identical hidden states, in bfloat16 and in an int4 shard computing in float32; so do the
    lone steps run beside another session's."""
    from meshnet.models.shard import ShardModel
    from meshnet.models.kernels import INVARIANT
    shard = ShardModel(tiny_model_path("tiny-llama"), LayerRange(0, 4), dtype=dtype, quantization=recipe)
    assert getattr(shard.blocks["0"].self_attn.config, INVARIANT) is True  # spans run position by position
    gen = torch.Generator().manual_seed(3)
    prompt, steps = torch.randint(3, 512, (1, 7), generator=gen), torch.randint(3, 512, (1, 5), generator=gen)
    span_cache, single_cache = KVCache(), KVCache()
    for cache in (span_cache, single_cache):
        shard.forward(shard.embed_tokens(prompt, 0), cache, 0)
    span = shard.forward(shard.embed_tokens(steps, 7), span_cache, 7)
    singles = [shard.forward(shard.embed_tokens(steps[:, i:i + 1], 7 + i), single_cache, 7 + i) for i in range(5)]
    assert torch.equal(span, torch.cat(singles, dim=1))
    other = KVCache()
    shard.forward(shard.embed_tokens(prompt[:, :3], 0), other, 0)
    packed = shard.forward_packed(torch.cat([shard.embed_tokens(steps[:, :1], 3),
                                             shard.embed_tokens(steps[:, 1:4], 12)], dim=1),
                                  [other, span_cache], [3, 12], [1, 3])
    alone = KVCache()
    shard.forward(shard.embed_tokens(prompt[:, :3], 0), alone, 0)
    assert torch.equal(packed[:, :1], shard.forward(shard.embed_tokens(steps[:, :1], 3), alone, 3))
