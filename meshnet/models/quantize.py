"""Quantized recipes: swap a shard's ``nn.Linear`` layers for bitsandbytes ones.

``int8`` uses ``bnb.nn.Linear8bitLt`` (LLM.int8(), Dettmers et al. 2022: row-wise absmax
int8 weights); ``nf4`` uses ``bnb.nn.Linear4bit`` with the NormalFloat4 data type (QLoRA,
Dettmers et al. 2023: 4-bit weights in blocks of 64 with one absmax each). Both run on the
CPU with bitsandbytes >= 0.49, and on CUDA GPUs with bitsandbytes' CUDA kernels. Embeddings, norms and the LM head stay in the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from meshnet.errors import ModelSourceError
from meshnet.protocol.control import RECIPES


def _replacement(linear: nn.Linear, recipe: str, compute_dtype: torch.dtype, device: str) -> nn.Module:
    import bitsandbytes as bnb

    bias = linear.bias is not None
    if recipe == "int8":
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False)
        q.load_state_dict(linear.state_dict())
    else:
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, quant_type="nf4",
                              compute_dtype=compute_dtype)
        q.weight = bnb.nn.Params4bit(linear.weight.data.to(torch.float32).contiguous(), requires_grad=False,
                                     quant_type="nf4")
        if bias:
            q.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return q.to(device)  # bitsandbytes quantizes the weight as it moves it: on a GPU, its CUDA layout


def quantize_linears(module: nn.Module, recipe: str, compute_dtype: torch.dtype, device: str = "cpu") -> int:
    """Replace every ``nn.Linear`` under ``module`` (weights on the CPU) in place with one
    quantized on ``device`` (``cpu`` or ``cuda:N``); returns how many were replaced.

    ``bfloat16``/``float32`` recipes leave the module unchanged (0).

    Raises:
        ModelSourceError: unknown recipe, or bitsandbytes is not installed.
    """
    if recipe in ("bfloat16", "float32"):
        return 0
    if recipe not in RECIPES:
        raise ModelSourceError(f"unknown recipe {recipe!r}", hint=f"use one of {', '.join(RECIPES)}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ModelSourceError("the int8/nf4 recipes need bitsandbytes",
                               hint="pip install 'bitsandbytes>=0.49'") from exc
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, _replacement(child, recipe, compute_dtype, device))
            count += 1
        else:
            count += quantize_linears(child, recipe, compute_dtype, device)
    return count
