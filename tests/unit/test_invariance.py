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
    measured = []
    monkeypatch.setattr(invariance, "rule_for", lambda linear, half_only=False: measured.append(half_only) or SPLIT_ROWS)
    half, single = nn.Linear(8, 8, dtype=torch.bfloat16), nn.Linear(8, 8)
    half.min_rows = 4  # a host whose float32 path runs products of 4 rows or more
    assert invariance.make_batch_invariant(nn.Sequential(half, single)) == {ANY_ROWS: 1}
    # auto: split left out, the host's fast path kept for one session's rows, several sessions' run apart
    assert type(half) is UpcastLinear and half.apart and measured == [True]
    assert half.min_rows == INVARIANT_SPAN + 1  # a speculative span's products stay on the half kernel
    assert type(single) is nn.Linear
    monkeypatch.setenv(invariance.ENV, "on")
    assert invariance.make_batch_invariant(nn.Sequential(half, single)) == {SPLIT_ROWS: 2}
    assert type(half) is UpcastLinear and single.rows_rule == half.rows_rule == SPLIT_ROWS
    assert half.min_rows == invariance.UPCAST_FROM and measured[1:] == [False, False]
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


@pytest.mark.parametrize("packed", [False, True])
def test_several_sessions_rows_get_what_each_gets_alone_where_a_float32_path_would_break_it(monkeypatch, packed):
    """A CPU without native bfloat16 runs products of ``min_rows`` rows and more in float32
    (ADR-0047), whose sums depend on the row count (rule ``split`` on this host's float32 kernels).
    Under ``auto`` a batch of several sessions (:func:`sessions_apart`) never sends rows of
    several sessions through that path: single rows and short spans run together on the half
    kernel, a span long enough for the float32 path alone (ADR-0064, amended 2026-12-08)."""
    from meshnet.models import kernels
    from meshnet.models.linears import pack, packing_available

    if packed and not packing_available(torch.bfloat16):
        pytest.skip("this CPU cannot pack bfloat16 weights (oneDNN needs AVX-512 or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    layer = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    if packed:
        pack(layer)
    else:
        layer.__class__ = UpcastLinear
    monkeypatch.setattr(invariance, "_RULES", {})
    layer.min_rows = 4
    invariance.make_batch_invariant(nn.Sequential(layer))
    assert layer.apart
    upcast = []
    product = kernels._float32_product
    monkeypatch.setattr(kernels, "_float32_product", lambda x, *a: upcast.append(x.numel() // 576) or product(x, *a))

    rows = torch.randn(8, 1, 576).to(torch.bfloat16)
    alone = torch.cat([layer(rows[b:b + 1]) for b in range(8)])
    with kernels.sessions_apart([1] * 8):  # a decode step of eight sessions
        together = layer(rows)
    assert torch.equal(together, alone) and upcast == []

    # a packed step: a decode step, a prefill chunk of 20 positions and a speculative span of 6
    spans = torch.randn(1, 27, 576).to(torch.bfloat16)
    alone = torch.cat([layer(spans[:, :1]), layer(spans[:, 1:21]), layer(spans[:, 21:])], dim=1)
    assert upcast == [20]  # alone, the chunk's product takes the float32 path
    upcast.clear()
    with kernels.sessions_apart([1, 20, 6]):
        together = layer(spans)
    assert torch.equal(together, alone)
    assert upcast == [20]  # the chunk alone, and nothing else
    # a speculative span stays on the half kernel, as its positions do one by one
    assert layer.min_rows == INVARIANT_SPAN + 1
    assert torch.equal(layer(spans[:, 21:]), torch.cat([layer(spans[:, p:p + 1]) for p in range(21, 27)], dim=1))
