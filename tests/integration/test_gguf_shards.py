"""A node fetches only its own layers from a GGUF: SmolLM2's GGUF is made a model directory
without dequantizing anything (config, tokenizer, the file and an index of where each tensor
lies), and a shard dequantizes only its own tensors, each equal to what transformers' whole-model
GGUF loader makes of it (float32); the whole model read the same way equals that loader's."""

from __future__ import annotations

import pytest
import torch

from meshnet.layers import LayerRange
from tests.integration.conftest import REAL


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory, real_model_path):
    from meshnet.models.checkpoints import index_gguf
    from meshnet.models.convert import GGUF_FILE, prepare_gguf

    extracted = real_model_path.resolve().parent.parent / "gguf" / REAL  # the default cache's (linked models)
    found = sorted(real_model_path.glob(GGUF_FILE)) or sorted(extracted.glob("*.gguf"))
    if not found:
        pytest.skip(f"no GGUF of {REAL} in {real_model_path} or {extracted} (make model extracts it)")
    target = tmp_path_factory.mktemp("gguf-model")
    prepare_gguf(found[0], target, say=lambda msg: None)
    index_gguf(target / GGUF_FILE, write=True)
    return target


def test_a_shard_dequantizes_only_its_own_tensors_and_they_equal_the_whole_models(gguf_model, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    from meshnet.models.shard import ShardModel

    names = {p.name for p in gguf_model.iterdir()}
    assert {"config.json", "generation_config.json", "model.gguf", "model.gguf.json", "tokenizer.json"} <= names
    assert not any(name.endswith(".safetensors") for name in names)  # nothing dequantized ahead
    read: list[str] = []
    real = gguf.dequantize
    monkeypatch.setattr(gguf, "dequantize", lambda data, kind: read.append(kind) or real(data, kind))
    shard = ShardModel(gguf_model, LayerRange(10, 20), dtype="float32")
    assert len(read) == 10 * 9  # nine tensors a layer (q, k, v, o, gate, up, down, two norms); no embeddings
    whole = AutoModelForCausalLM.from_pretrained(gguf_model, gguf_file="model.gguf", dtype=torch.float32).state_dict()
    mine = shard.blocks.state_dict()
    assert len(mine) == 90
    for name, tensor in mine.items():
        assert torch.equal(tensor, whole[f"model.layers.{name}"]), name


def test_the_whole_model_read_per_tensor_equals_transformers_gguf_loader(gguf_model):
    from transformers import AutoModelForCausalLM

    from meshnet.models.checkpoints import whole_model

    ours = whole_model(gguf_model).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(gguf_model, gguf_file="model.gguf", dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(theirs) and len(ours) == 273
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
