"""Model families: what differs between decoder architectures, stated once, chosen by ``config.json``.

A family says where a model's decoder layers, embeddings, final norm and positions live in the
transformers model, what kind of attention each layer runs, and a tiny seeded config that its
split-parity test builds. :func:`family_of` picks the family from the config's ``model_type``;
a type no family lists is refused, never loaded as another family (issue 25).

Each family listed here is certified by split parity (``tests/unit/test_families.py``): the model
split at every layer boundary, run as chunked prefill and then decode across the split, gives
float32 logits equal to the unsplit transformers model's. The attention kinds:

- ``full``: causal attention over the whole context.
- ``sliding``: causal attention over the last ``sliding_window`` positions (Mistral, and the
  sliding layers of Qwen2/Qwen3 with ``use_sliding_window``); :func:`meshnet.models.attention.attention`
  applies the window, since one causal mask serves every layer of a shard.

Families whose layers need more than this (Gemma's embedding scale and soft-capping, linear
attention with recurrent state, mixtures of experts) are not listed yet, so they are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnet.errors import ModelSourceError

__all__ = ["FAMILIES", "Family", "family_of", "layer_kinds"]

FULL, SLIDING = "full", "sliding"


@dataclass(frozen=True)
class Family:
    """One decoder architecture.

    Attributes:
        name: the family's name; ``model_types``: the ``config.json`` types it serves.
        layers_path: attribute path of the ``ModuleList`` of decoder layers.
        embed_path, norm_path: the token embeddings and the final norm.
        pos_embed_path: learned absolute positions (GPT-2), or None.
        rotary_path: the rotary embedding module (Llama and its kin), or None.
        tiny_config: a small config (``model_type`` included) its split-parity test builds with a
            fixed seed; it exercises the family's particular layers (a sliding window shorter
            than the test's prompt, for example).
    """

    name: str
    model_types: tuple[str, ...]
    layers_path: str
    embed_path: str
    norm_path: str
    pos_embed_path: str | None
    rotary_path: str | None
    tiny_config: dict = field(default_factory=dict, compare=False)


_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0}

#: the certified families, by name
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "llama", **_TINY, "tie_word_embeddings": True}),
    Family("gpt2", ("gpt2",), "transformer.h", "transformer.wte", "transformer.ln_f", "transformer.wpe", None,
           {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 512, "n_positions": 1024,
            "bos_token_id": 1, "eos_token_id": 2}),
    Family("mistral", ("mistral",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "mistral", **_TINY, "head_dim": 16, "sliding_window": 6}),
    Family("qwen2", ("qwen2",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "qwen2", **_TINY, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2,
            "tie_word_embeddings": True}),
    Family("qwen3", ("qwen3",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "qwen3", **_TINY, "head_dim": 16, "use_sliding_window": True, "sliding_window": 6,
            "max_window_layers": 2}),
)}
_BY_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def family_of(config) -> Family:
    """The family of a transformers config, by its ``model_type``.

    Raises:
        ModelSourceError: a type no certified family serves (it is refused, never run as another).
    """
    model_type = getattr(config, "model_type", None)
    family = _BY_TYPE.get(model_type)
    if family is None:
        raise ModelSourceError(f"model type {model_type!r} is not supported by meshnet",
                               hint=f"supported model types: {', '.join(sorted(_BY_TYPE))}; a family is added "
                                    f"once its split-parity test passes (meshnet/models/families.py)")
    return family


def layer_kinds(config) -> list[str]:
    """Each decoder layer's attention kind (:data:`FULL` or :data:`SLIDING`), from the config's
    ``layer_types`` (transformers' ``sliding_attention`` / ``full_attention``) or, without them,
    from ``sliding_window`` (set: every layer slides)."""
    count = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
    types = getattr(config, "layer_types", None)
    if types:
        return [SLIDING if t == "sliding_attention" else FULL for t in types]
    return [SLIDING if getattr(config, "sliding_window", None) else FULL] * count
