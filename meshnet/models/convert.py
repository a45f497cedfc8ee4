"""One-time GGUF → safetensors conversion into the local cache.

Loading a GGUF dequantizes every tensor (seconds for the whole model); doing it once and
saving float32 safetensors lets each node later read only its own layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

#: packages transformers needs to read a GGUF file (module name -> pip package)
GGUF_REQUIREMENTS = {"gguf": "gguf", "accelerate": "accelerate"}


def missing_gguf_requirements() -> list[str]:
    """The pip packages transformers' GGUF loader needs that are not importable here.

    Both are declared dependencies of meshnet; this names them when an install skipped them.
    """
    import importlib.util

    return [pkg for module, pkg in GGUF_REQUIREMENTS.items() if importlib.util.find_spec(module) is None]


def convert_gguf(gguf_path: Path, target: Path, say: Callable[[str], None]) -> Path:
    """Dequantize ``gguf_path`` with transformers and save config, tokenizer and float32
    safetensors into ``target`` (the caller's temporary directory: :func:`meshnet.models.sources.building`).

    Raises:
        meshnet.errors.ModelSourceError: a package the GGUF loader needs is missing (the hint names
            it), or transformers cannot read the file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshnet.errors import ModelSourceError

    missing = missing_gguf_requirements()
    if missing:
        raise ModelSourceError(f"cannot convert {gguf_path.name}: missing package(s) {', '.join(missing)}",
                               hint=f"pip install {' '.join(missing)} (declared in meshnet's dependencies)")
    say(f"converting {gguf_path.name} to safetensors (one time)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        raise ModelSourceError(f"cannot read GGUF {gguf_path}: {exc}",
                               hint=f"delete {gguf_path.parent} to fetch the file again") from exc
    # transformers refuses save_pretrained on a GGUF-loaded model; the dequantized
    # tensors are plain float32, so write them and a clean config directly.
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, target / "model.safetensors",
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
