"""Devices (meshnet.models.devices, ``--device``): what each value names, the errors for a device
this machine lacks, and the CPU path the default takes where no GPU exists."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from meshnet.errors import MeshnetError
from meshnet.models.devices import is_gpu, resolve_device


def test_auto_is_the_cpu_where_torch_sees_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == resolve_device(" CPU ") == "cpu"
    assert not is_gpu("cpu")


def test_auto_and_cuda_are_the_first_gpu_where_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [resolve_device(s) for s in ("auto", "cuda", "cuda:1", "CUDA:0")] == ["cuda:0", "cuda:0", "cuda:1", "cuda:0"]
    assert is_gpu("cuda:1")
    with pytest.raises(MeshnetError, match=r"--device cuda:2: this machine has 2 CUDA GPU\(s\)") as info:
        resolve_device("cuda:2")
    assert info.value.hint == "use cuda:0 to cuda:1"


NO_CUDA = "use --device cpu (or auto), or install a CUDA build of torch"
CHOICES = "use auto, cpu, cuda or cuda:N"


@pytest.mark.parametrize("spec, message, hint", [
    ("cuda", "--device cuda: this machine has no CUDA GPU that torch can use", NO_CUDA),
    ("cuda:0", "--device cuda:0: this machine has no CUDA GPU that torch can use", NO_CUDA),
    ("tpu", "--device 'tpu' is not a device", CHOICES),
    ("cuda:x", "--device 'cuda:x' is not a device", CHOICES),
])
def test_a_device_this_machine_lacks_is_one_error_naming_the_flag(monkeypatch, spec, message, hint):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MeshnetError) as info:
        resolve_device(spec)
    assert (info.value.message, info.value.hint, info.value.code) == (message, hint, "bad_device")


def test_node_start_with_cuda_on_a_machine_without_it_exits_with_one_line(monkeypatch):
    from meshnet.cli.main import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["node", "start", "--device", "cuda", "--port", "1"])
    assert result.exit_code == 1
    assert "--device cuda: this machine has no CUDA GPU that torch can use" in result.output
    assert "Traceback" not in result.output


def test_float16_is_refused_on_the_cpu_and_a_gpu_keeps_its_own_dtype(monkeypatch):
    import typer

    from meshnet.cli import services

    with pytest.raises(typer.Exit):
        services.compute_defaults(None, "float16", None, 2, "cpu")
    monkeypatch.setattr("meshnet.models.devices.gpu_dtype", lambda device: "bfloat16")
    choice = services.compute_defaults("tiny-llama", "auto", None, 4, "cuda:0")
    assert (choice.compute_dtype, choice.threads, choice.reason) == ("bfloat16", 4, "on cuda:0: bfloat16")
    given = services.compute_defaults("tiny-llama", "float16", 2, 4, "cuda:0")
    assert (given.compute_dtype, given.threads, given.reason) == ("float16", 2, "on cuda:0: float16 as given")


def test_a_node_on_the_cpu_offers_ram_whatever_gpus_the_machine_has(monkeypatch):
    from meshnet.node import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info = hardware.detect("cpu")
    assert (info.device, info.vram_bytes) == ("cpu", 0)
    assert hardware.node_memory_bytes(None, info) == info.ram_bytes > 0


def test_a_shard_on_the_cpu_device_returns_host_tensors(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshnet.layers import LayerRange
    from meshnet.models.caches import KVCache
    from meshnet.models.shard import ShardModel
    from meshnet.models.sources import byte_tokenizer

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    byte_tokenizer(512).save_pretrained(tmp_path)
    shard = ShardModel(tmp_path, LayerRange(0, 2), device="cpu")
    hidden = shard.forward(shard.embed_tokens(torch.tensor([[5, 6, 7]]), 0), KVCache(), 0)
    logits = shard.logits(hidden)
    assert (shard.device.type, hidden.device.type, logits.device.type, tuple(logits.shape)) == ("cpu", "cpu", "cpu",
                                                                                                (1, 3, 512))


def test_a_shard_too_big_for_the_gpu_is_one_error_and_leaves_no_slot(monkeypatch, tmp_path):
    from meshnet.layers import LayerRange
    from meshnet.node import slots
    from meshnet.node.runtime import NodeRuntime

    def too_big(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(slots, "measure_load", too_big)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runtime = NodeRuntime(compute_dtype="bfloat16", device="cuda:0")
    with pytest.raises(MeshnetError) as info:
        runtime.load("tiny-llama", tmp_path, LayerRange(0, 4))
    assert info.value.code == "device_memory" and info.value.status == 507
    assert info.value.message == ("tiny-llama layers 0-3 do not fit in cuda:0's free memory: CUDA out of memory. "
                                  "Tried to allocate 2.00 GiB")
    assert "--device cpu" in info.value.hint and runtime.slots == {}
