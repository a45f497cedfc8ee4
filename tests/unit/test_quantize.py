"""Quantized recipes on a tiny seeded model: linears swapped, doctor checks the tolerance."""

from __future__ import annotations

import pytest
import torch

from meshnet.errors import ModelSourceError
from meshnet.layers import LayerRange
from meshnet.models.quantize import quantize_linears
from meshnet.node.doctor import TOLERANCE, run_doctor
from meshnet.node.runtime import NodeRuntime


@pytest.mark.parametrize(("recipe", "weight_dtype"), [("int8", torch.int8), ("nf4", torch.uint8)])
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
