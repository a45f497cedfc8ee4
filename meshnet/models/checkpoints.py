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
from meshnet.models.families import Family, language_key

__all__ = ["Checkpoint", "dequantize_mxfp4", "stack_experts"]


class Checkpoint(contextlib.AbstractContextManager):
    """The safetensors tensors of the model at ``model_path``, by language-model name.

    The files are listed by ``model.safetensors.index.json`` (or, without one, every
    ``*.safetensors`` file's header); each is opened once, on the first read from it, and closed
    when the context ends.

    Raises:
        ModelSourceError: :meth:`tensor` of a name the checkpoint lacks.
    """

    def __init__(self, model_path: Path) -> None:
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
        if file not in self._handles:
            self._handles[file] = self._files.enter_context(safe_open(file, framework="pt"))
        return self._handles[file].get_tensor(self.stored[name])


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
