"""``meshnet models certify`` (meshnet.models.certify): split parity on a model the user has."""

from __future__ import annotations

import json
import shutil

from typer.testing import CliRunner

from meshnet.cli.main import app
from meshnet.models.sources import resolve


def test_certify_passes_every_split_of_a_tiny_model_and_says_so_as_json():
    result = CliRunner().invoke(app, ["models", "certify", "tiny-llama", "--prompt-tokens", "40", "--decode-tokens",
                                      "8", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["split"] for r in rows] == [[1], [2], [3], [1, 2], [1, 3], [2, 3]]
    assert all(r["passed"] and r["max_abs_diff"] <= 1e-4 and r["tokens_matched"] == r["tokens_decided"] for r in rows)


def test_certify_of_a_preset_whose_config_is_another_family_exits_1_naming_both(tmp_path, monkeypatch):
    model = tmp_path / "altered"
    shutil.copytree(resolve("tiny-llama"), model)
    presets = tmp_path / "presets.toml"
    presets.write_text(f'default = "altered"\n\n[models.altered]\nhf_repo = "x/altered"\nfamily = "gpt2"\n'
                       f'num_layers = 4\nhidden_size = 64\nbytes_per_layer = {{ bfloat16 = 57600 }}\n'
                       f'source = {{ kind = "local", path = "{model}" }}\n')
    monkeypatch.setenv("MESHNET_PRESETS", str(presets))
    result = CliRunner().invoke(app, ["models", "certify", "altered"])
    assert result.exit_code == 1
    assert "config.json is a llama model, its preset says gpt2" in result.output


def test_certify_refuses_a_split_outside_the_model(tmp_path):
    result = CliRunner().invoke(app, ["models", "certify", "tiny-llama", "--splits", "2;9", "--prompt-tokens", "8",
                                      "--decode-tokens", "2"])
    assert result.exit_code == 1 and "split (9,) is not inside the model's 4 layers" in result.output
