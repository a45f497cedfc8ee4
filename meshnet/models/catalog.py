"""Adding a model to the catalogue: a preset written from the model's own ``config.json``.

``meshnet models add <hub-id|dir>`` reads the config (from a hub: the config and tokenizer only,
no weights), checks that a certified family serves it (:func:`meshnet.models.families.family_of`),
and writes a preset whose layer count, hidden size and bytes per layer per recipe come from the
config, into the added presets file (:func:`meshnet.presets.user_presets_path`). Placement and
calibration then size shards of it like any built-in model.

Bytes per decoder layer (:func:`layer_bytes`) come from counting one layer's parameters: the
model is built from its config with one layer on the ``meta`` device (no memory, no weights),
``P`` is that layer's parameter count and ``L`` the part of it in linear weights
(``nn.Linear``, GPT-2's ``Conv1D``). Per recipe:

- ``bfloat16``: ``2 P`` (two bytes a parameter);
- ``int8``: ``L + 4 (P - L)``: one byte a linear weight, the rest (norms, biases) in float32;
- ``int4``: ``L / 2 + 4 L / 32 + 4 (P - L)``: half a byte a linear weight plus a bfloat16 scale and
  offset per group of 32 (:class:`meshnet.models.quantize.Int4Linear`), the rest counted as int8's;
- ``nf4``: ``L / 2 + L / 64 + 4 (P - L)``: half a byte a linear weight plus one byte of scale
  per 64-weight block.

The int8 and nf4 formulas are the sizes bitsandbytes shards of SmolLM2-135M measured at load
(the built-in preset's figures, which :func:`layer_bytes` reproduces exactly from that model's
config: ``tests/unit/test_catalog.py``); a shard's measured resident size replaces them once a
node reports it (ADR-0039).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from meshnet.errors import InvalidRequest, ModelSourceError
from meshnet.models.families import family_of, language_config
from meshnet.presets import ModelPreset, all_presets, forget_added, user_presets_path

__all__ = ["LayerParameters", "add_preset", "layer_bytes", "layer_parameters", "preset_for"]

#: weights per nf4 scale (bitsandbytes' default block size)
NF4_BLOCK = 64
#: input weights per int4 scale and offset (:class:`meshnet.models.quantize.Int4Linear` reads it from
#: here): divides the hidden and MLP widths of every family meshnet serves (SmolLM2: 576 and 1536);
#: a linear whose input width it does not divide stays unquantized
INT4_GROUP = 32


@dataclass(frozen=True)
class LayerParameters:
    """One decoder layer's parameter count (``total``) and the part of it in linear weights."""

    total: int
    linear: int


def layer_parameters(config) -> LayerParameters:
    """Count a decoder layer's parameters of the model ``config`` describes, on the ``meta``
    device (no weights are made): one layer of each kind the config's ``layer_types`` lists
    (a hybrid's linear-attention and full-attention layers differ), averaged over the model's
    layers and rounded up, so that the layer count times it is the decoder's size.

    Raises:
        ModelSourceError: no certified family serves the config (:func:`family_of`).
    """
    import copy
    import math
    from collections import Counter

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    family = family_of(config)
    counts = Counter(getattr(config, "layer_types", None) or [None])
    one = copy.deepcopy(config)
    for attr in ("num_hidden_layers", "n_layer"):
        if hasattr(one, attr):
            setattr(one, attr, len(counts))
    if getattr(one, "layer_types", None):
        one.layer_types = list(counts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one)
    layers = model.get_submodule(family.layers_path)
    total = linear = 0
    for layer, count in zip(layers, counts.values()):
        total += count * sum(p.numel() for p in layer.parameters())
        linear += count * sum(m.weight.numel() for m in layer.modules() if isinstance(m, (torch.nn.Linear, Conv1D)))
    n = sum(counts.values())
    return LayerParameters(math.ceil(total / n), math.ceil(linear / n))


def layer_bytes(params: LayerParameters) -> dict[str, int]:
    """Resident bytes of one decoder layer per recipe (the formulas of the module docstring)."""
    rest = 4 * (params.total - params.linear)
    return {"bfloat16": 2 * params.total, "int8": params.linear + rest,
            "int4": params.linear // 2 + 4 * (params.linear // INT4_GROUP) + rest,
            "nf4": params.linear // 2 + params.linear // NF4_BLOCK + rest}


def _default_name(source: str) -> str:
    """A preset name from a hub id or directory: its last part, lower case (``Qwen/Qwen3-0.6B`` →
    ``qwen3-0.6b``)."""
    return re.sub(r"[^a-z0-9._-]+", "-", Path(source.rstrip("/")).name.lower()).strip("-")


def _refuse_taken(name: str) -> None:
    """Raises InvalidRequest when a preset named ``name`` exists (built in or added)."""
    if name in all_presets():
        raise InvalidRequest(f"a preset named {name!r} exists already", hint="choose another with --name")


def preset_for(source: str, name: str | None = None, *, progress=None) -> ModelPreset:
    """The preset of ``source`` (a hub repository id or a local model directory), named ``name`` or
    after the source. A hub source fetches its config and tokenizer only.

    Raises:
        InvalidRequest: the name is taken by another preset, or is not a valid name.
        ModelSourceError: the source has no readable config, or no certified family serves it.
    """
    from transformers import AutoConfig

    from meshnet.models.sources import fetch_config

    name = name or _default_name(source)
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):
        raise InvalidRequest(f"preset name {name!r} is not valid: lower-case letters, digits, '.', '_' and '-'",
                             hint="choose one with --name")
    _refuse_taken(name)
    local = Path(source).expanduser()
    path = local if local.is_dir() else fetch_config(source, progress=progress)
    try:
        config = language_config(AutoConfig.from_pretrained(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # what a malformed config raises
        raise ModelSourceError(f"{source}: its config.json cannot be read: {exc}",
                               hint="point at a Hugging Face model directory or hub repository") from exc
    params = layer_parameters(config)
    num_layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
    src = {"kind": "local", "path": str(local.resolve())} if local.is_dir() else {"kind": "hub"}
    return ModelPreset(name=name, hf_repo=source if not local.is_dir() else name, family=family_of(config).name,
                       num_layers=num_layers, hidden_size=hidden, bytes_per_layer=layer_bytes(params), source=src)


def _toml(value) -> str:
    """``value`` (a string, int or flat dict of them) as TOML. A string is JSON's, its characters as
    they are: JSON escapes only quotes, backslashes and control characters, all as TOML does, while
    its ``\\uXXXX`` pairs for characters beyond U+FFFF are not valid TOML."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return str(value) if isinstance(value, int) else json.dumps(value, ensure_ascii=False)


def add_preset(preset: ModelPreset) -> Path:
    """Append ``preset`` to the added presets file; returns the file's path.

    Raises:
        InvalidRequest: a preset of that name exists already.
    """
    forget_added()  # read the file as it is now: another process may have added the name meanwhile
    _refuse_taken(preset.name)
    path = user_presets_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = {"hf_repo": preset.hf_repo, "family": preset.family, "num_layers": preset.num_layers,
              "hidden_size": preset.hidden_size, "bytes_per_layer": preset.bytes_per_layer, "source": preset.source}
    entry = f"\n[models.{json.dumps(preset.name)}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in fields.items())
    with path.open("a", encoding="utf-8") as out:
        if out.tell() == 0:
            out.write("# model presets added by `meshnet models add` (meshnet.models.catalog)\n")
        out.write(entry)
    forget_added()
    return path
