"""``meshnet models add`` (meshnet.models.catalog): a preset written from a model's config."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig
from typer.testing import CliRunner

from meshnet.cli.main import app
from meshnet.errors import ModelSourceError
from meshnet.models.catalog import LayerParameters, layer_bytes, layer_parameters, preset_for
from meshnet.models.sources import resolve
from meshnet.presets import all_presets, canonical_model_name, get_preset


@pytest.fixture
def added(tmp_path, monkeypatch):
    """An empty added-presets file of the test's own."""
    path = tmp_path / "added.toml"
    monkeypatch.setenv("MESHNET_USER_PRESETS", str(path))
    return path


def test_the_formula_gives_smollm2_s_measured_sizes_from_its_config():
    # SmolLM2-135M's config.json, less what does not change a layer's size
    config = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                  tie_word_embeddings=True)
    params = layer_parameters(config)
    assert params == LayerParameters(total=3_540_096, linear=3_538_944)
    assert layer_bytes(params) == get_preset("smollm2-135m-instruct").bytes_per_layer
    assert layer_bytes(params) == {"bfloat16": 7_080_192, "int8": 3_543_552, "int4": 2_216_448,
                                   "nf4": 1_829_376}


def test_gpt2_s_conv1d_weights_count_as_linear():
    config = AutoConfig.for_model("gpt2", n_embd=64, n_layer=4, n_head=4, vocab_size=512)
    # attention 64x192 + 64x64, MLP 64x256 + 256x64 (weights), biases 192+64+256+64, two layer norms 2x128
    assert layer_parameters(config) == LayerParameters(total=49_984, linear=49_152)


def test_add_writes_a_preset_every_command_then_knows(added):
    source = resolve("tiny-llama")
    result = CliRunner().invoke(app, ["models", "add", str(source), "--name", "my-tiny", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["presets_file"] == str(added)
    preset = all_presets()["my-tiny"]
    assert (preset.family, preset.num_layers, preset.hidden_size) == ("llama", 4, 64)
    assert preset.source == {"kind": "local", "path": str(source.resolve())}
    # hidden 64, 4 heads of 16, 2 key-value heads, MLP 128: 36,864 linear weights and two 64-wide norms
    assert preset.bytes_per_layer == {"bfloat16": 73_984, "int8": 37_376, "int4": 23_552, "nf4": 19_520}
    assert canonical_model_name("MY-TINY") == "my-tiny" and resolve("my-tiny") == source.resolve()
    listed = json.loads(CliRunner().invoke(app, ["models", "list", "--json"]).stdout)
    assert [r["name"] for r in listed][-1] == "my-tiny" and listed[-1]["cached"] is True


def test_a_taken_or_malformed_name_is_refused_and_nothing_is_written(added):
    source = str(resolve("tiny-llama"))
    taken = CliRunner().invoke(app, ["models", "add", source, "--name", "tiny-llama"])
    assert taken.exit_code == 1 and "a preset named 'tiny-llama' exists already" in taken.output
    bad = CliRunner().invoke(app, ["models", "add", source, "--name", "Not A Name"])
    assert bad.exit_code == 1 and "preset name 'Not A Name' is not valid" in bad.output
    assert not added.exists()


def test_a_model_of_no_certified_family_is_refused_naming_its_type(added, tmp_path):
    model = tmp_path / "odd"
    shutil.copytree(resolve("tiny-llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "olmo"}))
    with pytest.raises(ModelSourceError, match="model type 'olmo' is not supported by meshnet"):
        preset_for(str(model))
    result = CliRunner().invoke(app, ["models", "add", str(model)])
    assert result.exit_code == 1 and "supported model types:" in result.output and not added.exists()


def test_a_source_path_of_any_characters_round_trips_through_the_added_file(added, tmp_path):
    source = tmp_path / "modèle-😀"  # beyond U+FFFF: JSON would write a surrogate pair TOML refuses
    shutil.copytree(resolve("tiny-llama"), source)
    assert CliRunner().invoke(app, ["models", "add", str(source), "--name", "emoji"]).exit_code == 0
    assert all_presets()["emoji"].source == {"kind": "local", "path": str(source.resolve())}


def test_a_broken_added_file_is_one_error_line_naming_it_not_a_traceback(added):
    import subprocess
    import sys

    added.write_text("[models.x\n")
    run = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "models", "list"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"error: the added presets file {added} is not valid TOML" in run.stderr
