"""How a shard's linears run: weight layout (ADR-0048) and half-precision products in float32
from a measured row count (ADR-0047)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshnet.layers import LayerRange
from meshnet.models import linears
from meshnet.models.linears import (PackedLinear, UpcastLinear, apply_layouts, choose_layout, choose_min_rows, dense_weight,
                                    pack, set_weight, transpose, upcast_linears)
from meshnet.models.kernels import INVARIANT_SPAN
from meshnet.models.caches import KVCache
from meshnet.models.shard import ShardModel, prepare_layouts
from meshnet.node.doctor import weights_digest


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHNET_HOST_TIMINGS", str(tmp_path / "host-timings.json"))  # nothing measured yet
    linears.min_rows.cache_clear()
    linears.layout.cache_clear()
    yield monkeypatch
    linears.min_rows.cache_clear()
    linears.layout.cache_clear()


def test_the_float32_path_starts_where_it_wins_at_every_larger_count():
    # half kernel linear in rows, float32 path: a fixed cast plus a cheap product
    samples = {4: (1.0, 2.0), 8: (2.0, 2.1), 16: (4.0, 2.2), 32: (8.0, 2.6), 64: (16.0, 3.4)}
    assert choose_min_rows(samples) == 16
    assert choose_min_rows(samples, gain=2.0) == 32


def test_a_noisy_middle_sample_moves_the_start_above_it():
    samples = {8: (2.0, 1.0), 16: (2.0, 2.0), 32: (8.0, 2.6), 64: (16.0, 3.4)}
    assert choose_min_rows(samples) == 32


def test_fast_half_kernels_keep_every_product_in_half_precision():
    samples = {4: (1.0, 2.0), 16: (1.1, 2.2), 64: (1.5, 3.4)}
    assert choose_min_rows(samples) is None
    assert choose_min_rows({}) is None


def make_linear(dtype=torch.bfloat16, bias=True) -> torch.nn.Linear:
    torch.manual_seed(3)
    return torch.nn.Linear(24, 40, bias=bias).to(dtype)


@pytest.mark.parametrize("bias", [True, False])
def test_long_products_equal_the_float32_product_rounded_once(bias):
    linear = make_linear(bias=bias)
    assert upcast_linears(linear, 16) == 1 and isinstance(linear, UpcastLinear)
    x = torch.randn(2, 8, 24).to(torch.bfloat16)  # 16 rows
    b = None if linear.bias is None else linear.bias.float()
    want = F.linear(x.float(), linear.weight.float(), b).to(torch.bfloat16)
    assert torch.equal(linear(x), want)
    short = x[:, :7]  # 14 rows: the half kernel, exactly nn.Linear
    assert torch.equal(linear(short), F.linear(short, linear.weight, linear.bias))
    assert linear(x).dtype == torch.bfloat16 and linear(x).shape == (2, 8, 40)


def test_only_half_precision_linears_change():
    module = torch.nn.Sequential(make_linear(torch.bfloat16), make_linear(torch.float32), torch.nn.GELU(),
                                 make_linear(torch.float16))
    assert upcast_linears(module, None) == 0
    assert [type(m) for m in module] == [torch.nn.Linear, torch.nn.Linear, torch.nn.GELU, torch.nn.Linear]
    weight = module[0].weight
    assert upcast_linears(module, 8) == 2
    assert [type(m) for m in module] == [UpcastLinear, torch.nn.Linear, torch.nn.GELU, UpcastLinear]
    assert module[0].weight is weight and module[0].min_rows == 8 == module[3].min_rows
    assert upcast_linears(module, 32) == 2 and module[0].min_rows == 32  # again: the count changes


def test_the_environment_fixes_or_disables_the_row_count(fresh_choices):
    fresh_choices.setenv(linears.ENV, "off")
    assert linears.min_rows(torch.bfloat16) is None
    linears.min_rows.cache_clear()
    fresh_choices.setenv(linears.ENV, "24")
    assert linears.min_rows(torch.bfloat16) == 24
    assert linears.min_rows(torch.float32) is None  # float32 has nothing to cast
    linears.min_rows.cache_clear()
    fresh_choices.setenv(linears.ENV, "many")
    with pytest.raises(ValueError, match="MESHNET_UPCAST_MIN_ROWS must be 'off' or a positive row count"):
        linears.min_rows(torch.bfloat16)


def test_measure_times_both_paths_at_every_count():
    samples = linears.measure(torch.bfloat16, rows=(2, 16), repeats=2, calls=1)
    assert sorted(samples) == [2, 16]
    assert all(half > 0 and cast > 0 for half, cast in samples.values())


def test_a_bfloat16_shard_prefills_in_float32_and_decodes_in_bfloat16(tiny_model_path, fresh_choices):
    fresh_choices.setenv(linears.ENV, "16")
    path = tiny_model_path("tiny-llama")
    shard = ShardModel(path, LayerRange(1, 3), dtype="bfloat16")
    modules = [m for m in shard.blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert len(modules) == 2 * 7 and {type(m) for m in modules} == {UpcastLinear}
    # under the default batch invariance a speculative span's products stay on the half kernel (ADR-0064)
    assert {m.min_rows for m in modules} == {max(16, INVARIANT_SPAN + 1)}
    reference = ShardModel(path, LayerRange(1, 3), dtype="float32")
    assert not any(isinstance(m, UpcastLinear) for m in reference.blocks.modules())
    hidden = torch.randn(1, 20, shard.config.hidden_size, generator=torch.Generator().manual_seed(5))
    cache = KVCache()
    out = shard.forward(hidden, cache, 0)
    step = shard.forward(hidden[:, :1], cache, 20)
    want = reference.forward(torch.cat([hidden, hidden[:, :1]], 1), KVCache(), 0)
    assert out.dtype == step.dtype == torch.bfloat16
    error = (torch.cat([out, step], 1).float() - want).norm() / want.norm()
    assert error < 0.02, error


def test_the_layout_with_the_smallest_worst_slowdown_is_chosen():
    # float32 decoder weights on the CI host: faster at both counts
    assert choose_layout({"row": {1: 0.55, 8: 1.31}, "transposed": {1: 0.42, 8: 0.85}}) == "transposed"
    # a bfloat16 LM head: much faster alone, slower at 8 rows; worst slowdowns 1.86 against 1.26
    assert choose_layout({"row": {1: 14.47, 8: 39.61}, "transposed": {1: 7.76, 8: 49.9}}) == "transposed"
    # the reverse: a little faster alone, much slower batched (1.20 against 1.61)
    assert choose_layout({"row": {1: 0.48, 8: 1.43}, "transposed": {1: 0.40, 8: 2.30}}) == "row"
    # within 5 % (1.067 against 1.049): noise, nn.Linear's own layout
    assert choose_layout({"row": {1: 0.48, 8: 1.43}, "transposed": {1: 0.45, 8: 1.50}}) == "row"
    assert choose_layout({"row": {1: 1.0}, "transposed": {1: 0.9}}, gain=1.2) == "row"
    assert choose_layout({}) == "row"


def test_a_layout_a_little_slower_alone_and_twice_as_fast_batched_is_chosen():
    # float32 [576, 1536] on a 2-core AVX-512 host, ms; the mean cost per row would pick transposed
    samples = {"row": {1: 0.321, 8: 0.458}, "transposed": {1: 0.207, 8: 0.465}, "packed": {1: 0.270, 8: 0.276}}
    assert choose_layout(samples) == "packed"  # worst slowdowns 1.66, 1.68, 1.30
    # a layout not timed at every count is no candidate
    assert choose_layout({"row": {1: 1.0, 8: 2.0}, "packed": {1: 0.5}}) == "row"


def test_transposed_weights_keep_shape_values_and_products(fresh_choices):
    fresh_choices.setenv(linears.LAYOUT_ENV, "transposed")
    module = torch.nn.Sequential(make_linear(torch.float32), torch.nn.GELU(), make_linear(torch.float32, bias=False))
    before = [m.weight.detach().clone() for m in (module[0], module[2])]
    x = torch.randn(8, 24)
    want = module[0](x)
    assert apply_layouts(module) == {"transposed": 2}
    for m, w in zip((module[0], module[2]), before):
        assert m.weight.shape == (40, 24) and m.weight.stride() == (1, 40)  # stored [in, out]
        assert torch.equal(m.weight, w) and not m.weight.requires_grad
    assert torch.allclose(module[0](x), want, rtol=1e-5, atol=1e-6)
    stored = module[0].weight.data_ptr()
    transpose(module[0])  # again: already stored so, nothing copied
    assert module[0].weight.data_ptr() == stored and module[0].weight.stride() == (1, 40)


def test_small_weights_keep_row_unmeasured_and_large_ones_are_measured_once(fresh_choices):
    calls = []

    def fake_measure(dtype, shape):
        calls.append((dtype, shape))
        return {"row": {1: 2.0, 8: 8.0}, "transposed": {1: 1.0, 8: 4.0}}

    fresh_choices.setattr(linears, "measure_layout", fake_measure)
    assert linears.layout(torch.float32, (40, 24)) == "row"
    assert linears.layout(torch.float32, (1536, 576)) == "transposed"
    assert linears.layout(torch.float32, (1536, 576)) == "transposed"
    assert linears.layout(torch.bfloat16, (1536, 576)) == "transposed"
    assert calls == [(torch.float32, (1536, 576)), (torch.bfloat16, (1536, 576))]


#: whether oneDNN packs bfloat16 on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not on AVX2 alone)
BF16_PACKS = linears.packing_available(torch.bfloat16)
NO_BF16_PACKING = "this CPU's oneDNN cannot pack bfloat16 (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"


def test_measure_layout_times_every_layout_at_every_count():
    assert linears.available_layouts(torch.float32) == linears.LAYOUTS  # the CPU torch wheel has oneDNN
    samples = linears.measure_layout(torch.float32, (96, 64), rows=(1, 8), repeats=1, total_bytes=1 << 20)
    assert sorted(samples) == ["packed", "row", "transposed"]
    assert all(sorted(by_rows) == [1, 8] and min(by_rows.values()) > 0 for by_rows in samples.values())


def test_bfloat16_is_packed_only_where_onednn_can():
    # on an AVX2-only CPU, oneDNN's bfloat16 reorder raises: a bfloat16 shard's timing and load
    # must leave packing out there, not fail
    assert BF16_PACKS == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    want = linears.LAYOUTS if BF16_PACKS else ("row", "transposed")
    assert linears.available_layouts(torch.bfloat16) == want
    samples = linears.measure_layout(torch.bfloat16, (96, 64), rows=(1, 8), repeats=1, total_bytes=1 << 20)
    assert tuple(samples) == want


def test_a_bfloat16_shard_loads_with_every_weight_measured(tiny_model_path, fresh_choices):
    fresh_choices.setattr(linears, "LAYOUT_MIN_ELEMENTS", 0)  # the tiny model's weights are measured too
    shard = ShardModel(tiny_model_path("tiny-llama"), LayerRange(0, 2), dtype="bfloat16")
    kinds = {type(m) for m in [*shard.blocks.modules(), shard.lm_head] if isinstance(m, torch.nn.Linear)}
    assert kinds <= ({torch.nn.Linear, UpcastLinear, PackedLinear} if BF16_PACKS else {torch.nn.Linear, UpcastLinear})
    logits = shard.logits(shard.forward(shard.embed_tokens(torch.tensor([[3, 1, 4]]), 0), KVCache(), 0))
    assert logits.shape == (1, 3, shard.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.skipif(BF16_PACKS, reason="this CPU's oneDNN packs bfloat16: nothing is refused")
def test_packing_bfloat16_where_onednn_cannot_is_refused_by_name(fresh_choices):
    fresh_choices.setenv(linears.LAYOUT_ENV, "packed")
    with pytest.raises(ValueError, match="cannot store bfloat16 weights"):
        linears.layout(torch.bfloat16, (1536, 576))
    with pytest.raises(RuntimeError, match="bfloat16 weights cannot be packed"):
        pack(make_linear(torch.bfloat16))


def test_stream_bytes_exceed_the_caches_within_bounds():
    assert 32 << 20 <= linears.stream_bytes() <= 256 << 20


def test_the_environment_fixes_the_layout(fresh_choices):
    fresh_choices.setenv(linears.LAYOUT_ENV, "row")
    assert linears.layout(torch.float32, (1536, 576)) == "row"
    linears.layout.cache_clear()
    fresh_choices.setenv(linears.LAYOUT_ENV, "transposed")
    assert linears.layout(torch.float32, (4, 4)) == "transposed"  # forced: even a small weight
    linears.layout.cache_clear()
    fresh_choices.setenv(linears.LAYOUT_ENV, "columns")
    with pytest.raises(ValueError, match="MESHNET_WEIGHT_LAYOUT must be one of row, transposed"):
        linears.layout(torch.float32, (1536, 576))


def shards_in_each_layout(path, layers: LayerRange, env) -> dict[str, ShardModel]:
    """One float32 shard of ``layers`` per layout, each forced through :data:`linears.LAYOUT_ENV`."""
    shards = {}
    for name in linears.LAYOUTS:
        linears.layout.cache_clear()
        env.setenv(linears.LAYOUT_ENV, name)
        shards[name] = ShardModel(path, layers, dtype="float32")
    return shards


def test_a_transposed_shard_holds_the_same_weights_and_computes_the_same(tiny_model_path, fresh_choices):
    shards = shards_in_each_layout(tiny_model_path("tiny-llama"), LayerRange(1, 3), fresh_choices)
    down = {name: shard.blocks["1"].mlp.down_proj.weight for name, shard in shards.items()}
    assert down["row"].is_contiguous() and not down["transposed"].is_contiguous() and down["packed"].is_mkldnn
    assert weights_digest(shards["row"]) == weights_digest(shards["transposed"]) == weights_digest(shards["packed"])
    hidden = torch.randn(3, 1, shards["row"].config.hidden_size, generator=torch.Generator().manual_seed(2))
    out = {}
    for name, shard in shards.items():
        caches = [KVCache() for _ in range(3)]
        for row, cache in enumerate(caches):
            shard.forward(hidden[row:row + 1].expand(1, 4 + row, -1), cache, 0)
        out[name] = shard.forward_batch(hidden, caches, [4, 5, 6])
    assert torch.allclose(out["row"], out["transposed"], rtol=1e-4, atol=1e-5)
    assert torch.allclose(out["row"], out["packed"], rtol=1e-4, atol=1e-5)


def test_a_transposed_entry_keeps_its_head_tied_and_its_logits(tiny_model_path, fresh_choices):
    shards = shards_in_each_layout(tiny_model_path("tiny-llama"), LayerRange(0, 2), fresh_choices)
    vocab, hidden = shards["row"].lm_head.weight.shape
    head = shards["transposed"].lm_head.weight
    assert head.stride() == (1, vocab) and shards["row"].lm_head.weight.stride() == (hidden, 1)
    assert (shards["transposed"].embed.weight is head) == (shards["row"].embed.weight is shards["row"].lm_head.weight)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    embedded = {name: shard.embed_tokens(ids, 0) for name, shard in shards.items()}
    assert torch.equal(embedded["row"], embedded["transposed"])
    logits = {name: shard.logits(shard.forward(embedded[name], KVCache(), 0)) for name, shard in shards.items()}
    digests = {weights_digest(shard) for shard in shards.values()}
    assert logits["row"].shape == (1, 5, vocab)
    assert torch.allclose(logits["row"], logits["transposed"], rtol=1e-4, atol=1e-5)
    assert torch.allclose(logits["row"], logits["packed"], rtol=1e-4, atol=1e-5)
    assert digests == {weights_digest(shards["row"])}


def test_a_packed_entry_keeps_plain_embeddings_beside_its_packed_head(tiny_model_path, fresh_choices):
    shards = shards_in_each_layout(tiny_model_path("tiny-llama"), LayerRange(0, 2), fresh_choices)
    packed, row = shards["packed"], shards["row"]
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.weight.is_mkldnn
    assert not packed.embed.weight.is_mkldnn and packed.embed.weight.is_contiguous()
    assert torch.equal(packed.embed.weight, row.embed.weight)
    assert torch.equal(dense_weight(packed.lm_head), row.lm_head.weight)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_PACKS, reason=NO_BF16_PACKING))])
def test_packed_weights_keep_their_values_state_and_products(fresh_choices, dtype):
    fresh_choices.setenv(linears.LAYOUT_ENV, "packed")
    module = torch.nn.Sequential(make_linear(dtype), torch.nn.GELU(), make_linear(dtype, bias=False))
    before = [m.weight.detach().clone() for m in (module[0], module[2])]
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = [module[0](x), module[2](x)]
    assert apply_layouts(module) == {"packed": 2}
    assert apply_layouts(module) == {}  # packed already: nothing again
    for m, w in zip((module[0], module[2]), before):
        assert isinstance(m, PackedLinear) and m.weight.is_mkldnn and m.weight.shape == (40, 24)
        assert "weight" not in dict(m.named_parameters())  # a buffer: one copy of the weight, no gradient
        assert torch.equal(dense_weight(m), w)
        state = m.state_dict()["weight"]
        assert not state.is_mkldnn and state.is_contiguous() and torch.equal(state, w)
    tolerance = {"rtol": 2e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for m, expected in zip((module[0], module[2]), want):
        got = m(x)
        assert got.dtype == dtype and got.shape == (8, 40)
        assert torch.allclose(got.float(), expected.float(), **tolerance)
        assert torch.allclose(m(x[None]).float(), got[None].float(), **tolerance)  # [batch, seq, in]
    set_weight(module[2], before[1] * 2)
    assert module[2].weight.is_mkldnn and torch.equal(dense_weight(module[2]), before[1] * 2)


@pytest.mark.skipif(not BF16_PACKS, reason=NO_BF16_PACKING)
def test_a_packed_half_linear_runs_long_products_in_float32_rounded_once():
    linear = make_linear(torch.bfloat16)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    pack(linear)
    assert upcast_linears(linear, 4) == 1 and isinstance(linear, PackedLinear) and linear.min_rows == 4
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = F.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
    assert torch.equal(linear(x), want)
    short = linear(x[:2])  # under min_rows: oneDNN's bfloat16 kernel
    assert short.dtype == torch.bfloat16 and torch.allclose(short.float(), want[:2].float(), rtol=2e-2, atol=1e-2)


def test_prepare_layouts_measures_before_the_load_what_the_load_would(tiny_model_path, fresh_choices):
    calls = []

    def fake_measure(dtype, shape):
        calls.append(shape)
        return {"row": {1: 2.0, 8: 8.0}, "transposed": {1: 1.0, 8: 4.0}}

    fresh_choices.setattr(linears, "measure_layout", fake_measure)
    fresh_choices.setattr(linears, "LAYOUT_MIN_ELEMENTS", 0)  # the tiny model's weights are measured too
    path = tiny_model_path("tiny-llama")
    assert prepare_layouts(path, LayerRange(1, 3), dtype="float32") == len(calls)
    shapes = list(calls)
    middle = ShardModel(path, LayerRange(1, 3), dtype="float32")
    assert calls == shapes  # the load measured nothing more
    assert set(shapes) == {tuple(m.weight.shape) for m in middle.blocks.modules() if isinstance(m, torch.nn.Linear)}
    assert len(shapes) == len(set(shapes))  # each shape once
    assert middle.blocks["1"].mlp.down_proj.weight.stride()[0] == 1  # and used what was measured
    assert prepare_layouts(path, LayerRange(0, 2), dtype="float32") == len(shapes) + 1
    assert calls == shapes + [(middle.config.vocab_size, middle.config.hidden_size)]  # the LM head, once more
    assert prepare_layouts(path, LayerRange(1, 3), dtype="float32", quantization="int8") == 0
