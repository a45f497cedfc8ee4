"""Quantized recipes: swap a shard's ``nn.Linear`` layers for quantized ones.

``int8`` on the CPU is :class:`Int8Linear`: weight-only int8 with one absmax scale per output
channel, multiplied by torch's own int8 kernel (``torch._weight_int8pack_mm``, bfloat16
activations). On a CUDA GPU (or a torch without that kernel) it is bitsandbytes'
``bnb.nn.Linear8bitLt`` (LLM.int8(), Dettmers et al. 2022: row-wise absmax int8 weights).
``int4`` (the CPU only) is :class:`Int4Linear`: weight-only 4-bit integers with a bfloat16 scale
and offset per group of :data:`INT4_GROUP` input weights, multiplied by torch's own kernel
(``torch._weight_int4pack_mm_for_cpu``). ``nf4`` is ``bnb.nn.Linear4bit`` with the NormalFloat4
data type (QLoRA, Dettmers et al. 2023: 4-bit weights in blocks of 64 with one absmax each), on
the CPU and on CUDA. ``int4`` quantizes the entry's LM head too (:func:`quantize_head`);
embeddings, norms and the other recipes' heads stay in the compute dtype.

Why torch's kernel for CPU int8 (ADR-0061): on the 2-core CI host, one ``[rows, 576] x
[576, 1536]`` product took 0.37 ms with it against 0.47 ms in bfloat16 and 1.15 ms with
bitsandbytes (float32 activations; 5.0 ms with bfloat16 ones) at 1 row, and 0.96 / 2.23 /
2.42 ms at 8 rows: bitsandbytes made int8 shards smaller but several times slower than bfloat16.
"""

from __future__ import annotations

import torch
from torch import nn

from meshnet.errors import ModelSourceError
from meshnet.models.catalog import INT4_GROUP
from meshnet.protocol.control import RECIPES


def int8_kernel_available() -> bool:
    """Whether this torch has the CPU weight-only int8 kernel :class:`Int8Linear` uses."""
    return hasattr(torch, "_weight_int8pack_mm")


#: torch's CPU packing takes output widths in multiples of this (``_convert_weight_to_int4pack_for_cpu``)
INT4_ROWS = 16


def int4_fits(linear: nn.Linear) -> bool:
    """Whether torch's 4-bit kernel takes ``linear``: input width a multiple of :data:`INT4_GROUP`,
    output width of :data:`INT4_ROWS`."""
    return linear.in_features % INT4_GROUP == 0 and linear.out_features % INT4_ROWS == 0


def int4_kernel_available() -> bool:
    """Whether this torch has the CPU 4-bit kernel :class:`Int4Linear` uses."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def _torch_int8(recipe: str, device: str) -> bool:
    """Whether ``recipe`` on ``device`` is :class:`Int8Linear` (else bitsandbytes)."""
    return recipe == "int8" and device == "cpu" and int8_kernel_available()


class Int8Linear(nn.Module):
    """A weight-only int8 ``nn.Linear`` for the CPU (ADR-0061).

    ``weight``: int8 ``[out, in]``, ``round(w / scale)`` clamped to [-127, 127]; ``scales``:
    bfloat16 ``[out]``, each row's absmax / 127 (rounded to bfloat16 before the weights are
    quantized against it, so ``weight * scales`` is the nearest product to ``w``); ``bias``:
    bfloat16 ``[out]`` or None. :meth:`forward` takes ``[..., in]`` in any float dtype, multiplies in
    bfloat16 with torch's ``_weight_int8pack_mm`` (float32 accumulation) and returns ``[..., out]``
    in the input's dtype.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(torch.float32)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        q = torch.round(w / scales.to(torch.float32)[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(rows, self.weight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(nn.Module):
    """A weight-only 4-bit ``nn.Linear`` for the CPU (ADR-0062), group-wise asymmetric.

    Each group of :data:`INT4_GROUP` consecutive input weights of a row gets a bfloat16 ``scale`` =
    (max - min) / 15 and ``offset`` = min + 8 scale; a weight is stored as ``q = round((w - min) /
    scale)`` in [0, 15] and read back as ``(q - 8) * scale + offset`` (the layout of torch's
    ``_weight_int4pack_mm_for_cpu``). Buffers: ``weight`` uint8 ``[out, in / 2]`` (two weights a
    byte, torch's packed order), ``scales_and_zeros`` bfloat16 ``[in / group, out, 2]``, ``bias``
    bfloat16 ``[out]`` or None: 0.5 + 4 / group bytes a weight (0.625 at group 32, against 2 in
    bfloat16). :meth:`forward` takes ``[..., in]`` in any float dtype, multiplies in bfloat16
    (float32 accumulation) and returns ``[..., out]`` in the input's dtype.

    Raises:
        ValueError: the kernel does not take the linear's widths (:func:`int4_fits`).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if not int4_fits(linear):
            raise ValueError(f"int4 needs input widths in multiples of {INT4_GROUP} and output widths in multiples of "
                             f"{INT4_ROWS}, not {self.in_features} -> {self.out_features}")
        groups = self.in_features // INT4_GROUP
        w = linear.weight.detach().to(torch.float32).reshape(self.out_features, groups, INT4_GROUP)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        offsets = (low + 8 * scales.to(torch.float32)).to(torch.bfloat16)
        # quantized against the rounded scale and offset, so dequantizing gives the nearest values
        base = offsets.to(torch.float32) - 8 * scales.to(torch.float32)
        q = torch.round((w - base[..., None]) / scales.to(torch.float32)[..., None]).clamp(0, 15)
        packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(self.out_features, -1).to(torch.int32), 1)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", torch.stack([scales, offsets], dim=-1).transpose(0, 1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.weight, INT4_GROUP, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={INT4_GROUP}, "
                f"bias={self.bias is not None}")


def quantize_head(head: nn.Linear) -> nn.Module:
    """The entry's LM head (``[vocab, hidden]`` on the CPU) as an :class:`Int4Linear` copy for the
    ``int4`` recipe, or ``head`` itself where torch's kernel is missing or refuses its widths. The
    head's weight tensor is left as it was (a tied embedding keeps reading it). ``int8`` keeps a
    bfloat16 head: its kernel ran SmolLM2's head no faster than the packed bfloat16 one (2.79 against
    2.95 ms a token, ADR-0062)."""
    if int4_kernel_available() and int4_fits(head):
        return Int4Linear(head)
    return head


def quantize_shard(blocks: nn.Module, head: nn.Module | None, recipe: str, compute_dtype: torch.dtype,
                   device: str = "cpu") -> nn.Module | None:
    """:func:`quantize_linears` over a shard's decoder ``blocks``, in place; returns the shard's LM
    head to keep (None without one): for ``int4`` its :func:`quantize_head` copy, the largest
    product of a decode step (ADR-0062), else ``head`` as given.

    Raises:
        ModelSourceError: as :func:`quantize_linears`.
    """
    quantize_linears(blocks, recipe, compute_dtype, device)
    if head is not None and recipe == "int4" and isinstance(head, nn.Linear):
        return quantize_head(head)
    return head


def _replacement(linear: nn.Linear, recipe: str, compute_dtype: torch.dtype, device: str) -> nn.Module:
    if _torch_int8(recipe, device):
        return Int8Linear(linear)
    if recipe == "int4":
        return Int4Linear(linear) if int4_fits(linear) else linear.to(compute_dtype)
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

    ``int4`` keeps a linear the kernel does not take (:func:`int4_fits`) in the compute dtype
    (counted all the same).

    Raises:
        ModelSourceError: unknown recipe; ``int4`` off the CPU or without torch's 4-bit kernel;
            bitsandbytes is not installed.
    """
    if recipe in ("bfloat16", "float32"):
        return 0
    if recipe not in RECIPES:
        raise ModelSourceError(f"unknown recipe {recipe!r}", hint=f"use one of {', '.join(RECIPES)}")
    if recipe == "int4" and (device != "cpu" or not int4_kernel_available()):
        raise ModelSourceError(f"the int4 recipe runs on the CPU only, with torch's 4-bit kernel (here: {device}, "
                               f"torch {torch.__version__})", hint="use nf4 on a GPU, or --device cpu")
    if recipe != "int4" and not _torch_int8(recipe, device):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise ModelSourceError(f"the {recipe} recipe on {device} needs bitsandbytes",
                                   hint="pip install 'bitsandbytes>=0.49'") from exc
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, _replacement(child, recipe, compute_dtype, device))
            count += 1
        else:
            count += quantize_linears(child, recipe, compute_dtype, device)
    return count
