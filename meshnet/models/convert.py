"""A GGUF file made a model directory of the local cache, without dequantizing it.

The directory holds the config and tokenizer transformers reads from the file's metadata and
the file itself; a node reading its shard dequantizes only its own layers' tensors
(:class:`meshnet.models.checkpoints.GGUFTensors`), never the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

#: a GGUF model's file inside its cache directory (read by :class:`meshnet.models.checkpoints.GGUFTensors`)
GGUF_FILE = "model.gguf"
#: packages transformers needs to read a GGUF file (module name -> pip package)
GGUF_REQUIREMENTS = {"gguf": "gguf", "accelerate": "accelerate"}


def missing_gguf_requirements() -> list[str]:
    """The pip packages transformers' GGUF loader needs that are not importable here.

    Both are declared dependencies of meshnet; this names them when an install skipped them.
    """
    import importlib.util

    return [pkg for module, pkg in GGUF_REQUIREMENTS.items() if importlib.util.find_spec(module) is None]


def prepare_gguf(gguf_path: Path, target: Path, say: Callable[[str], None]) -> Path:
    """Make ``target`` (the caller's temporary directory: :func:`meshnet.models.sources.building`)
    a model directory of the GGUF file ``gguf_path``: its config, generation config and tokenizer,
    read from the file's metadata by transformers, and the file itself as
    :data:`GGUF_FILE` (a hard link where the file system allows, else
    a copy). No tensor is dequantized here: each node dequantizes only its own layers' tensors
    when it loads them (:class:`meshnet.models.checkpoints.GGUFTensors`), into its compute dtype.

    Raises:
        meshnet.errors.ModelSourceError: a package the GGUF loader needs is missing (the hint names
            it), or transformers cannot read the file.
    """
    import os
    import shutil

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from meshnet.errors import ModelSourceError

    missing = missing_gguf_requirements()
    if missing:
        raise ModelSourceError(f"cannot convert {gguf_path.name}: missing package(s) {', '.join(missing)}",
                               hint=f"pip install {' '.join(missing)} (declared in meshnet's dependencies)")
    say(f"reading {gguf_path.name}: config and tokenizer (its tensors are dequantized by each node, its own only)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for an unreadable file
        raise ModelSourceError(f"cannot read GGUF {gguf_path}: {exc}",
                               hint=f"delete {gguf_path.parent} to fetch the file again") from exc
    target.mkdir(parents=True, exist_ok=True)
    settings = config.to_dict()
    settings.pop("quantization_config", None)
    settings["dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(settings, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    try:
        os.link(gguf_path, target / GGUF_FILE)
    except OSError:  # another file system, or no hard links: a copy
        shutil.copyfile(gguf_path, target / GGUF_FILE)
    return target
