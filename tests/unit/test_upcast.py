"""Half-precision products in float32 from a measured row count (ADR-0047)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshnet.layers import LayerRange
from meshnet.models import upcast
from meshnet.models.shard import KVCache, ShardModel
from meshnet.models.upcast import UpcastLinear, choose_min_rows, upcast_linears


@pytest.fixture
def fresh_min_rows(monkeypatch):
    upcast.min_rows.cache_clear()
    yield monkeypatch
    upcast.min_rows.cache_clear()


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


def test_the_environment_fixes_or_disables_the_row_count(fresh_min_rows):
    fresh_min_rows.setenv(upcast.ENV, "off")
    assert upcast.min_rows(torch.bfloat16) is None
    upcast.min_rows.cache_clear()
    fresh_min_rows.setenv(upcast.ENV, "24")
    assert upcast.min_rows(torch.bfloat16) == 24
    assert upcast.min_rows(torch.float32) is None  # float32 has nothing to cast
    upcast.min_rows.cache_clear()
    fresh_min_rows.setenv(upcast.ENV, "many")
    with pytest.raises(ValueError, match="MESHNET_UPCAST_MIN_ROWS must be 'off' or a positive row count"):
        upcast.min_rows(torch.bfloat16)


def test_measure_times_both_paths_at_every_count():
    samples = upcast.measure(torch.bfloat16, rows=(2, 16), repeats=2, calls=1)
    assert sorted(samples) == [2, 16]
    assert all(half > 0 and cast > 0 for half, cast in samples.values())


def test_a_bfloat16_shard_prefills_in_float32_and_decodes_in_bfloat16(tiny_model_path, fresh_min_rows):
    fresh_min_rows.setenv(upcast.ENV, "16")
    path = tiny_model_path("tiny-llama")
    shard = ShardModel(path, LayerRange(1, 3), dtype="bfloat16")
    linears = [m for m in shard.blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 7 and {type(m) for m in linears} == {UpcastLinear}
    assert {m.min_rows for m in linears} == {16}
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
