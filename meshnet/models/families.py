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
  sliding layers of Qwen2/Qwen3 with ``use_sliding_window``); :func:`meshnet.models.kernels.attention`
  applies the window, since one causal mask serves every layer of a shard.

Mixtures of experts (Mixtral, Qwen3-MoE) load their per-expert checkpoint tensors into the
stacked experts transformers runs (:class:`ExpertLayout`). Gemma 3's text decoder scales its
embeddings (inside its embedding module), gives local and global layers their own rotary bases
(``rotary_by_layer_type``), and may soft-cap its final logits (``final_logit_softcapping``,
applied by :meth:`meshnet.models.shard.ShardModel.logits`). gpt-oss alternates sliding and full
layers, adds a learned sink logit per head to every softmax
(:func:`meshnet.models.kernels.sink_attention`) and ships its experts as MXFP4
(:func:`meshnet.models.checkpoints.dequantize_mxfp4`). A multimodal wrapper whose text model is a
family (``gemma3`` around ``gemma3_text``) is served as its language model
(:func:`language_config`, :func:`language_key`). Families whose layers need more (linear
attention with recurrent state) are not listed yet, so they are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnet.errors import ModelSourceError

__all__ = ["FAMILIES", "WRAPPED_PREFIXES", "ExpertLayout", "Family", "family_of", "language_config", "language_key",
           "layer_kinds", "load_config"]

FULL, SLIDING, LINEAR = "full", "sliding", "linear"


@dataclass(frozen=True)
class ExpertLayout:
    """How a mixture-of-experts checkpoint stores its experts one by one while the transformers
    module holds them stacked: ``gate_up_proj`` ``[experts, 2 × intermediate, hidden]`` (each
    expert's gate rows, then its up rows) and ``down_proj`` ``[experts, hidden, intermediate]``.

    Attributes:
        checkpoint: the experts' prefix inside a layer's checkpoint keys (``block_sparse_moe.experts``).
        module: the stacked experts module inside a layer (``mlp.experts``).
        gate, up, down: each expert's projection names (``w1``, ``w3``, ``w2`` for Mixtral).
        count: the config attribute holding the number of experts.
    """

    checkpoint: str
    module: str
    gate: str
    up: str
    down: str
    count: str


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
        renames: ``(checkpoint infix, module infix)`` pairs for a layer's tensors whose checkpoint
            name differs from the module's (Mixtral's router: ``block_sparse_moe.gate.`` is
            ``mlp.gate.``).
        experts: how the checkpoint stores a mixture-of-experts layer's experts (None: no experts).
        rotary_by_layer_type: the rotary embedding takes the layer's type (Gemma 3: local sliding
            layers and global layers use different bases), so each layer gets its type's positions.
        rotary_axes: position axes of the rotary embedding (Qwen3.5's multimodal rotary: 3, time,
            height and width, all equal to the token position for text).
    """

    name: str
    model_types: tuple[str, ...]
    layers_path: str
    embed_path: str
    norm_path: str
    pos_embed_path: str | None
    rotary_path: str | None
    tiny_config: dict = field(default_factory=dict, compare=False)
    renames: tuple[tuple[str, str], ...] = ()
    experts: ExpertLayout | None = None
    rotary_by_layer_type: bool = False
    rotary_axes: int = 1


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
    Family("phi3", ("phi3",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "phi3", **_TINY, "sliding_window": 6}),
    Family("mixtral", ("mixtral",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "mixtral", **_TINY, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
            "sliding_window": 6},
           renames=(("block_sparse_moe.gate.", "mlp.gate."),),
           experts=ExpertLayout("block_sparse_moe.experts", "mlp.experts", "w1", "w3", "w2", "num_local_experts")),
    Family("qwen3_moe", ("qwen3_moe",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "qwen3_moe", **_TINY, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True},
           experts=ExpertLayout("mlp.experts", "mlp.experts", "gate_proj", "up_proj", "down_proj", "num_experts")),
    Family("gemma3", ("gemma3_text",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "gemma3_text", **_TINY, "head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "final_logit_softcapping": 30.0},
           rotary_by_layer_type=True),
    Family("qwen3_5", ("qwen3_5_text",), "model.layers", "model.embed_tokens", "model.norm", None,
           "model.rotary_emb",
           {"model_type": "qwen3_5_text", **_TINY, "head_dim": 16, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]},
           rotary_axes=3),
    Family("qwen3_next", ("qwen3_next",), "model.layers", "model.embed_tokens", "model.norm", None,
           "model.rotary_emb",
           {"model_type": "qwen3_next", **_TINY, "head_dim": 16, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]},
           experts=ExpertLayout("mlp.experts", "mlp.experts", "gate_proj", "up_proj", "down_proj", "num_experts")),
    Family("gpt_oss", ("gpt_oss",), "model.layers", "model.embed_tokens", "model.norm", None, "model.rotary_emb",
           {"model_type": "gpt_oss", **_TINY, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
            "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32,
                                "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 150000.0}}),
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
        return [{"sliding_attention": SLIDING, "linear_attention": LINEAR}.get(t, FULL) for t in types]
    return [SLIDING if getattr(config, "sliding_window", None) else FULL] * count


#: where multimodal wrappers (Gemma 3's ``gemma3``, Qwen3.5's ``qwen3_5``, …) keep their language
#: model's tensors: (stored prefix, the language model's own prefix). The first is what
#: transformers 5 saves, the second and third what releases saved by earlier versions hold.
WRAPPED_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head."))


def language_key(key: str) -> str:
    """A checkpoint tensor's name in its language model: a wrapper's prefix
    (:data:`WRAPPED_PREFIXES`) becomes the text model's; every other name is kept."""
    for stored, own in WRAPPED_PREFIXES:
        if key.startswith(stored):
            return own + key[len(stored):]
    return key


def language_config(config):
    """The config of the language model meshnet serves: a multimodal wrapper's ``text_config``
    where the wrapper's own type is not a family and its text model's is (``gemma3`` →
    ``gemma3_text``); any other config as it is (an unknown type is then refused by
    :func:`family_of`)."""
    text = getattr(config, "text_config", None)
    if getattr(config, "model_type", None) not in _BY_TYPE and getattr(text, "model_type", None) in _BY_TYPE:
        return text
    return config


def load_config(model_path):
    """The language model's config (:func:`language_config`) of the model directory ``model_path``.

    Raises:
        OSError, ValueError: no readable ``config.json`` (transformers' own errors).
    """
    from transformers import AutoConfig

    return language_config(AutoConfig.from_pretrained(model_path))
