"""A model directory's tensors, by the names a shard's modules give them.

A checkpoint names its tensors as the transformers class that saved it: a text model
``model.layers.3.…``, a multimodal wrapper ``model.language_model.layers.3.…`` (or, saved by older
releases, ``language_model.model.layers.3.…``). :class:`Checkpoint` reads every one of them by
its language model's name (:func:`meshnet.models.families.language_key`), so a shard loads the
language model out of a wrapper as out of a text model, and never reads the vision tower.

Two stored forms differ from the modules' and are converted at load: experts stored one by one
where transformers runs them stacked (:func:`stack_experts`), and experts stored as MXFP4
(:func:`dequantize_mxfp4`, gpt-oss's released checkpoints).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from meshnet.errors import ModelSourceError
from meshnet.layers import LayerRange
from meshnet.models.convert import GGUF_FILE
from meshnet.models.families import Family, language_key

__all__ = ["GGUF_FILE", "Checkpoint", "GGUFTensors", "dequantize_mxfp4", "index_gguf", "stack_experts",
           "whole_model"]


class Checkpoint(contextlib.AbstractContextManager):
    """The safetensors tensors of the model at ``model_path``, by language-model name.

    The files are listed by ``model.safetensors.index.json`` (or, without one, every
    ``*.safetensors`` file's header); each is opened once, on the first read from it, and closed
    when the context ends.

    Raises:
        ModelSourceError: :meth:`tensor` of a name the checkpoint lacks.
    """

    def __init__(self, model_path: Path, config=None) -> None:
        from safetensors import safe_open

        self.model_path = Path(model_path)
        index = self.model_path / "model.safetensors.index.json"
        if index.exists():
            stored = {key: self.model_path / name for key, name in json.loads(index.read_text())["weight_map"].items()}
        else:
            stored = {}
            for file in sorted(self.model_path.glob("*.safetensors")):
                with safe_open(file, framework="pt") as fh:
                    stored.update({key: file for key in fh.keys()})
        self.files: dict[str, Path] = {}
        self.stored: dict[str, str] = {}
        for key, file in stored.items():
            name = language_key(key)
            self.files[name], self.stored[name] = file, key
        self._files = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}
        #: a GGUF model (no safetensors): its tensors, dequantized one at a time as they are read
        self._gguf = GGUFTensors(self.model_path / GGUF_FILE, config) \
            if not stored and (self.model_path / GGUF_FILE).exists() else None
        if self._gguf is not None:
            self.files = {name: self._gguf.path for name in self._gguf.names}

    def __exit__(self, *exc) -> None:
        self._files.close()
        self._handles.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        """Every tensor's language-model name."""
        return list(self.files)

    def tensor(self, name: str) -> torch.Tensor:
        """The stored tensor ``name`` (its stored dtype, on the CPU)."""
        from safetensors import safe_open

        file = self.files.get(name)
        if file is None:
            raise ModelSourceError(f"{self.model_path}: missing tensor {name}",
                                   hint="the checkpoint is incomplete: delete it from the cache to fetch it again")
        if self._gguf is not None:
            return self._gguf.tensor(name)
        if file not in self._handles:
            self._handles[file] = self._files.enter_context(safe_open(file, framework="pt"))
        return self._handles[file].get_tensor(self.stored[name])


class GGUFTensors:
    """The tensors of a GGUF file by their transformers names, each dequantized when it is read.

    The names and the per-architecture fixes (Llama's query and key rows, which llama.cpp stores
    permuted for its rotary layout) are transformers' own GGUF loader's
    (``transformers.modeling_gguf_pytorch_utils``), applied to one tensor at a time: a node
    dequantizes only its own layers' tensors, to float32 (then cast into the shard's compute
    dtype), never the whole model. Where each tensor lies in the file is indexed once, when the
    model is prepared (:func:`index_gguf`, ``model.gguf.json`` beside the file): a load then
    reads no metadata, only its tensors' bytes (memory-mapped).

    Raises:
        ModelSourceError: a tensor the file lacks.
    """

    def __init__(self, path: Path, config=None) -> None:
        import numpy as np
        from transformers import AutoConfig
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = Path(path)
        sidecar = self.path.with_name(self.path.name + ".json")
        index = json.loads(sidecar.read_text()) if sidecar.exists() else index_gguf(self.path)
        config = (config or AutoConfig.from_pretrained(self.path.parent)).to_dict()
        #: the whole file, mapped once: each tensor is a plain view of its bytes (no memmap
        #: bookkeeping on the thousands of views gguf's dequantizer makes: a tenth of a load)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        self.processor = TENSOR_PROCESSORS.get(index["architecture"], TensorProcessor)(config=config)
        self.parsed = {"config": config, "tensors": {}}
        self.tensors: dict[str, dict] = index["tensors"]  # transformers name -> where and how it is stored
        self.names = list(self.tensors)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (a transformers name) dequantized to float32."""
        import numpy as np
        from gguf import GGMLQuantizationType, dequantize

        entry = self.tensors.get(name)
        if entry is None:
            raise ModelSourceError(f"{self.path}: no tensor for {name}",
                                   hint="the GGUF file is incomplete or of another model: delete it to fetch it again")
        dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
        size = int(np.prod(shape)) * dtype.itemsize
        data = self.data[entry["offset"]:entry["offset"] + size].view(dtype).reshape(shape)
        result = self.processor.process(weights=dequantize(data, GGMLQuantizationType(entry["type"])),
                                        name=entry["gguf"], tensor_key_mapping={}, parsed_parameters=self.parsed)
        # copied only where it is not already a fresh float32 array (a float32 tensor is the file's own bytes)
        return torch.from_numpy(np.require(result.weights, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


def index_gguf(path: Path, write: bool = False) -> dict:
    """Where each tensor of the GGUF file ``path`` lies, by its transformers name (mapped by
    transformers' GGUF loader for the config beside the file): ``{"architecture", "tensors":
    {name: {"gguf", "type", "dtype", "shape", "offset"}}}``; with ``write``, also kept as
    ``<file>.json`` for :class:`GGUFTensors`.

    Only architectures whose tensors transformers maps one by one are read this way (its plain,
    Llama and Gemma processors); its mixture-of-experts processors split and join tensors across
    the whole file.

    Raises:
        ModelSourceError: an architecture transformers' GGUF loader does not map one tensor at a time.
    """
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, Gemma2TensorProcessor,
                                                          LlamaTensorProcessor, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    path = Path(path)
    reader = GGUFReader(path)
    architecture = str(read_field(reader, "general.architecture")[0])
    if TENSOR_PROCESSORS.get(architecture, TensorProcessor) not in (TensorProcessor, LlamaTensorProcessor,
                                                                     Gemma2TensorProcessor):
        raise ModelSourceError(f"{path}: a GGUF of architecture {architecture!r} cannot be read one tensor at a "
                               f"time", hint="use the model's safetensors (a hub id or a local directory)")
    config = AutoConfig.from_pretrained(path.parent)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    try:
        mapping = get_gguf_hf_weights_map(skeleton, TENSOR_PROCESSORS.get(architecture, TensorProcessor)(
            config=config.to_dict()))
    except NotImplementedError as exc:
        raise ModelSourceError(f"{path}: transformers cannot map a GGUF of architecture {architecture!r}: {exc}",
                               hint="use the model's safetensors (a hub id or a local directory)") from exc
    tensors = {mapping[t.name]: {"gguf": t.name, "type": int(t.tensor_type), "dtype": t.data.dtype.str,
                                 "shape": list(t.data.shape), "offset": int(t.data_offset)}
               for t in reader.tensors if t.name in mapping}
    index = {"architecture": architecture, "tensors": tensors}
    if write:
        path.with_name(path.name + ".json").write_text(json.dumps(index))
    return index


def stack_experts(checkpoint: Checkpoint, family: Family, config, layers: LayerRange,
                  params: dict[str, torch.Tensor], loaded: set[str]) -> None:
    """Fill each layer's stacked experts (``blocks.{i}.<module>.gate_up_proj`` and ``down_proj`` in
    ``params``) from a checkpoint that stores them one by one
    (:class:`meshnet.models.families.ExpertLayout`); a checkpoint already stacked was loaded by
    name, and what is filled is added to ``loaded``.

    Raises:
        ModelSourceError: an expert's tensor is missing.
    """
    layout, count = family.experts, int(getattr(config, family.experts.count))
    for i in range(layers.start, layers.end):
        target, stored = f"blocks.{i}.{layout.module}", f"{family.layers_path}.{i}.{layout.checkpoint}"
        if f"{target}.gate_up_proj" in loaded or f"{target}.gate_up_proj" not in params:
            continue
        expert = [{name: checkpoint.tensor(f"{stored}.{e}.{name}.weight") for name in (layout.gate, layout.up, layout.down)}
                  for e in range(count)]
        with torch.no_grad():
            params[f"{target}.gate_up_proj"].copy_(
                torch.stack([torch.cat([w[layout.gate], w[layout.up]]) for w in expert]))
            params[f"{target}.down_proj"].copy_(torch.stack([w[layout.down] for w in expert]))
        loaded.update({f"{target}.gate_up_proj", f"{target}.down_proj"})


def dequantize_mxfp4(checkpoint: Checkpoint, wanted: dict[str, str], params: dict[str, torch.Tensor],
                     loaded: set[str]) -> None:
    """Fill each parameter the checkpoint stores as MXFP4 with its values: ``<name>_blocks``
    (uint8 ``[..., groups, 16]``, two 4-bit codes a byte) and ``<name>_scales`` (uint8
    ``[..., groups]``, a power-of-two exponent biased by 127 for each group of 32 values), the OCP
    microscaling format of gpt-oss's released experts. transformers' own converter dequantizes
    them, into the parameter's dtype.

    Args:
        wanted: checkpoint name → the shard's parameter name, for the shard's tensors.
    """
    packed = {name[:-len("_blocks")]: key for key, name in wanted.items() if name.endswith("_blocks")}
    for name, key in packed.items():
        scales = key[:-len("_blocks")] + "_scales"
        if name not in params or name in loaded or scales not in checkpoint:
            continue
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        values = convert_moe_packed_tensors(checkpoint.tensor(key), checkpoint.tensor(scales), dtype=params[name].dtype)
        with torch.no_grad():
            params[name].copy_(values)
        loaded.add(name)


def whole_model(model_path: Path, dtype: torch.dtype = torch.float32):
    """The whole transformers model of a cache directory (the reference meshnet's splits are
    compared with): from its safetensors, or built from its config and filled with its GGUF
    file's tensors as :class:`GGUFTensors` reads them (the values transformers' own GGUF loader
    gives, ``tests/integration/test_gguf_shards.py``, without its seconds of metadata parsing).

    Raises:
        OSError, ValueError: transformers' own, for a directory it cannot load.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_path)
    if any(path.glob("*.safetensors")) or not (path / GGUF_FILE).exists():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tensors = GGUFTensors(path / GGUF_FILE)
    with torch.random.fork_rng():  # the random initial weights are all replaced; the caller's seed is kept
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    missing, unexpected = model.load_state_dict({n: tensors.tensor(n) for n in tensors.names}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{path / GGUF_FILE} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()
