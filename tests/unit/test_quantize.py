"""Quantized recipes on a tiny seeded model: linears swapped, doctor checks the tolerance."""

from __future__ import annotations

import pytest
import torch

from meshnet.errors import ModelSourceError
from meshnet.layers import LayerRange
from meshnet.models.quantize import quantize_linears
from meshnet.node.doctor import TOLERANCE, run_doctor
from meshnet.node.runtime import NodeRuntime


@pytest.mark.parametrize(("recipe", "weight_dtype"), [("int8", torch.int8), ("int4", torch.uint8),
                                                      ("nf4", torch.uint8)])
def test_recipe_swaps_every_linear_and_passes_doctor(recipe, weight_dtype, tiny_model_path):
    runtime = NodeRuntime()
    slot = runtime.load("tiny-llama", tiny_model_path("tiny-llama"), LayerRange(1, 3), quantization=recipe)
    linears = [m for m in slot.shard.blocks.modules() if hasattr(m, "weight") and m.weight is not None
               and m.weight.dim() == 2]
    assert len(linears) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert {m.weight.dtype for m in linears} == {weight_dtype}
    report = run_doctor(slot)
    assert report.passed, report.reason
    assert report.recipe.quantization == recipe
    assert 0 < report.reference_rel_error <= TOLERANCE[recipe]
    assert report.tolerance == TOLERANCE[recipe]


def test_unquantized_recipes_change_nothing_and_unknown_is_an_error():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert quantize_linears(module, "bfloat16", torch.float32) == 0
    assert isinstance(module[0], torch.nn.Linear)
    with pytest.raises(ModelSourceError, match="unknown recipe 'fp8'"):
        quantize_linears(module, "fp8", torch.float32)


@pytest.mark.parametrize("recipe", ["bfloat16", "int8"])
def test_doctor_reports_the_resident_bytes_measured_at_load(recipe, tiny_model_path):
    runtime = NodeRuntime()
    slot = runtime.load("tiny-llama", tiny_model_path("tiny-llama"), LayerRange(1, 3), quantization=recipe)
    assert slot.resident_bytes >= slot.shard.weight_bytes() > 0
    report = run_doctor(slot)
    assert report.passed, report.reason
    assert report.resident_bytes == slot.resident_bytes > 0
    if recipe == "bfloat16":   # the process's fixed costs (modeling code, first kernels) are not the shard's
        assert slot.resident_bytes < 8 * 1024**2


def test_int4_linear_multiplies_as_its_dequantized_weights_and_holds_five_sixteenths_of_bfloat16():
    from meshnet.models.quantize import INT4_GROUP, Int4Linear
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48, bias=True)
    q = Int4Linear(linear)
    assert (q.weight.dtype, tuple(q.weight.shape)) == (torch.uint8, (48, 48))  # two weights a byte
    assert (q.scales_and_zeros.dtype, tuple(q.scales_and_zeros.shape)) == (torch.bfloat16, (96 // INT4_GROUP, 48, 2))
    weight_bytes = q.weight.numel() + q.scales_and_zeros.numel() * 2
    assert weight_bytes / (linear.weight.numel() * 2) == 5 / 16
    # the weights read back from the stored groups: (q - 8) * scale + offset
    scales, offsets = q.scales_and_zeros[..., 0].T.float(), q.scales_and_zeros[..., 1].T.float()
    w = linear.weight.detach().reshape(48, 3, INT4_GROUP)
    base = offsets - 8 * scales
    levels = torch.round((w - base[..., None]) / scales[..., None]).clamp(0, 15)
    dequantized = ((levels - 8) * scales[..., None] + offsets[..., None]).reshape(48, 96)
    assert ((dequantized - linear.weight).abs() <= scales.repeat_interleave(INT4_GROUP, 1) / 2 + 1e-3).all()
    x = torch.randn(2, 5, 96)
    reference = x.to(torch.bfloat16).float() @ dequantized.T + linear.bias.detach().to(torch.bfloat16).float()
    out = q(x)
    assert out.shape == (2, 5, 48) and out.dtype == torch.float32
    assert ((out - reference).norm() / reference.norm()).item() < 0.01


def test_int4_keeps_a_linear_its_group_does_not_divide_and_refuses_a_gpu():
    from meshnet.models.quantize import Int4Linear
    module = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 8))
    assert quantize_linears(module, "int4", torch.bfloat16) == 3
    assert isinstance(module[0], Int4Linear)
    for kept in (module[1], module[2]):  # 16 inputs: no group of 32; 8 outputs: not a multiple of 16
        assert type(kept) is torch.nn.Linear and kept.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiples of 32 and output widths in multiples of 16, not 16 -> 64"):
        Int4Linear(torch.nn.Linear(16, 64))
    with pytest.raises(ModelSourceError, match="int4 recipe runs on the CPU only"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(64, 16)), "int4", torch.bfloat16, device="cuda:0")


def test_an_int4_entry_quantizes_its_head_and_keeps_its_embeddings(tiny_model_path):
    from meshnet.models.quantize import Int4Linear
    plain = NodeRuntime().load("tiny-llama", tiny_model_path("tiny-llama"), LayerRange(0, 2)).shard
    slot = NodeRuntime().load("tiny-llama", tiny_model_path("tiny-llama"), LayerRange(0, 2), quantization="int4")
    shard = slot.shard
    assert isinstance(shard.lm_head, Int4Linear)
    assert shard.embed.weight.dtype == plain.embed.weight.dtype and shard.embed.weight.is_floating_point()
    assert torch.equal(shard.embed.weight, plain.embed.weight)  # lookups read the unquantized table
    hidden = torch.randn(1, 3, shard.lm_head.in_features)
    ours, reference = shard.logits(hidden), plain.logits(hidden)
    assert ours.shape == reference.shape and ours.dtype == torch.float32
    assert ((ours - reference).norm() / reference.norm()).item() < 0.1
    report = run_doctor(slot)
    assert report.passed, report.reason
