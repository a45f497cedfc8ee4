"""A shard: real transformers decoder layers for one ``LayerRange`` of one model.

The model skeleton is built on the ``meta`` device from the model's ``config.json`` (no
memory), the layers outside the shard are discarded, and only the shard's tensors are
read from the safetensors cache and materialised. An entry shard (one that starts at
layer 0) also holds the embeddings, final norm, LM head and tokenizer.

The model's family (:mod:`meshnet.models.families`) is chosen from its ``config.json``: where
its layers, embeddings, norm and positions live. A type no certified family serves is refused.
A sliding-window layer attends to its window only (:func:`attention`), whatever mask the shard
builds for its full-attention layers.

Memory (ADR-0039): a shard holds its own parameters and nothing else. Tensors are read one
at a time from the safetensors file (the mapping is closed after the shard is read) and cast
straight into the shard's parameters, and freed heap pages are handed back to the OS after
loading. transformers' modeling code costs a fixed ~100 MiB per process whatever the shard
(:func:`import_runtime`); a node pays it once, before any shard, so a shard's measured
memory is its own.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import inspect
import logging
from pathlib import Path

import torch
from torch import nn

from meshnet.errors import InvalidRequest, ModelSourceError
from meshnet.layers import LayerRange
from meshnet.models.checkpoints import Checkpoint, dequantize_mxfp4, stack_experts
from meshnet.models.families import LINEAR, family_of, layer_kinds, load_config
from meshnet.models.caches import BatchCache, KVCache, PackedCache, causal_mask
from meshnet.models.invariance import applies as invariance_applies, make_batch_invariant
from meshnet.models.kernels import ATTENTION, IN_FLOAT32, INVARIANT, _register_attention, sessions_apart
from meshnet.models.linears import apply_layouts, attention_in_float32, layout, min_rows, upcast_linears

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: transformers modules every node needs whatever its shard: the modeling base (it imports
#: torch.distributed, torch._dynamo, sympy and accelerate: ~86 MiB resident) and the families' layers
RUNTIME_MODULES = ("transformers.modeling_utils", "transformers.models.llama.modeling_llama",
                   "transformers.models.gpt2.modeling_gpt2")


def import_runtime() -> None:
    """Import transformers' modeling code (:data:`RUNTIME_MODULES`) now.

    It is a fixed cost of the process (about 100 MiB resident on CPU, measured by
    ``bench/memory.py``), paid by the first shard otherwise; a node calls this before it
    measures a shard's own memory. Idempotent.
    """
    for name in RUNTIME_MODULES:
        importlib.import_module(name)


@functools.cache
def warm_runtime(dtype: str) -> None:
    """Import the modeling code (:func:`import_runtime`) and run a tiny seeded one-layer model of
    each family once in compute dtype ``dtype`` (``float32``, ``bfloat16``, ``float16``).

    The first forward of a process pages in the kernels' code and sets up torch's compute
    state: about 10-15 MiB on CPU whatever the shard. A node calls this before it measures a
    shard, so that fixed cost is not charged to the first shard. Once per dtype per process.
    A half dtype's crossover to float32 products (:func:`meshnet.models.linears.min_rows`) is
    measured here too, for the same reason, and the heap its timing used is handed back.

    Raises:
        KeyError: unknown ``dtype``.
    """
    import_runtime()
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    configs = (LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, max_position_embeddings=64),
               GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0,
                          eos_token_id=0))
    for config in configs:
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
        with torch.inference_mode():
            model(torch.arange(16)[None], use_cache=True)
            model(torch.arange(1)[None] + 16)
    min_rows(DTYPES[dtype])
    attention_in_float32(DTYPES[dtype])
    trim_heap()  # the crossover's timing allocated several times the last-level cache; give it back


def trim_heap() -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim(0)``).

    Loading casts and copies tensors; glibc keeps the freed pages in its arenas unless asked.
    Returns False where the C library has no ``malloc_trim`` (musl, macOS, Windows).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc's on Linux
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def position_ids(position: int | list[int], seq: int) -> torch.Tensor:
    """Absolute positions ``[rows, seq]`` (int64) of ``seq`` tokens starting at ``position``: one
    start for a single row, or one start per row."""
    if isinstance(position, int):
        return torch.arange(position, position + seq)[None]
    return torch.tensor(position)[:, None] + torch.arange(seq)[None]


def _get(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _window(layer: nn.Module, config) -> int | None:
    """The sliding window a decoder layer's attention passes (None: full attention, or no
    attention module): the module's own ``sliding_window`` where it has one (Qwen2/3, Gemma 3,
    gpt-oss set it per layer type), else the config's (Mistral, Phi-3 and Mixtral read it there
    for every layer)."""
    attention = getattr(layer, "self_attn", None)
    if attention is None:
        return None
    window = attention.sliding_window if hasattr(attention, "sliding_window") else getattr(config, "sliding_window", None)
    return int(window) if window else None


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The whole model of ``config`` on the ``meta`` device (shapes only, no memory).

    Built with transformers' eager attention, which every family has (gpt-oss has no SDPA path);
    a shard then runs meshnet's own (:data:`ATTENTION`) whatever the skeleton was built with."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")


def prepare_layouts(model_path: Path, layers: LayerRange, *, dtype: str = "float32", load_head: bool | None = None,
                    quantization: str = "bfloat16") -> int:
    """Measure now the weight layouts (ADR-0048), float32 crossover and attention path (ADR-0047)
    that loading :class:`ShardModel` with the same arguments will use, and hand back the heap
    the timing used.

    The timing is a cost of the process, once per dtype and weight shape: it allocates several
    times the last-level cache, and about 13 MiB of it stayed resident after a measured load of
    SmolLM2 layers 10-19 (``bench/memory.py``). A node calls this before it measures a shard's
    memory, so that figure is the shard's own. Returns how many weight shapes it measured or
    found measured (quantized layers have none: their modules are bitsandbytes').

    Raises:
        KeyError: unknown ``dtype``; OSError and ValueError: an unreadable ``config.json``.
    """
    config = load_config(model_path)
    skeleton = _meta_model(config, DTYPES[dtype])
    modules: list[nn.Module] = []
    if quantization in ("bfloat16", "float32"):
        all_layers = _get(skeleton, family_of(config).layers_path)
        modules += [all_layers[i] for i in range(layers.start, min(layers.end, len(all_layers)))]
    if (layers.start == 0) if load_head is None else load_head:
        modules.append(skeleton.get_output_embeddings())
    shapes = {(child.weight.dtype, tuple(child.weight.shape)) for module in modules for child in module.modules()
              if isinstance(child, nn.Linear)}
    for weight_dtype, shape in shapes:
        layout(weight_dtype, shape)
    min_rows(DTYPES[dtype])
    attention_in_float32(DTYPES[dtype])
    trim_heap()
    return len(shapes)


class ShardModel:
    """Decoder layers ``layers`` of the model at ``model_path``, ready to run.

    Args:
        model_path: HF-format directory with config.json and safetensors (see sources.resolve).
        layers: the half-open layer range served.
        dtype: compute dtype name (``float32``, ``bfloat16``).
        load_head: load embeddings, final norm, LM head and tokenizer (default: when
            ``layers.start == 0``).
        quantization: recipe of the decoder layers' linear weights: ``bfloat16`` (none,
            weights in the compute dtype), ``int8``, ``int4`` or ``nf4`` (see quantize.py).
        device: ``cpu`` or ``cuda:N`` (:func:`meshnet.models.devices.resolve_device`): where the
            weights, KV caches and states live and the layers run. The tensors are read into host
            memory first and moved (quantized recipes: quantized as they move); every method
            takes and returns host tensors, so the wire reads each step's output once.

    Raises:
        ModelSourceError: missing tensors or a range beyond the model's layer count.
        torch.OutOfMemoryError: the shard does not fit in the GPU's free memory.
    """

    def __init__(self, model_path: Path, layers: LayerRange, *, dtype: str = "float32",
                 load_head: bool | None = None, quantization: str = "bfloat16", device: str = "cpu") -> None:
        self.model_path = Path(model_path)
        self.config = load_config(self.model_path)
        self.num_layers = int(self.config.num_hidden_layers)
        if layers.end > self.num_layers:
            raise ModelSourceError(f"shard {layers} beyond the model's {self.num_layers} layers")
        self.layers = layers
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.family = family_of(self.config)
        #: linear-attention layers: no mask (transformers' modules read one as padding), states in the cache
        self._linear = {i for i, kind in enumerate(layer_kinds(self.config)) if kind == LINEAR}
        self.is_entry = layers.start == 0 if load_head is None else load_head
        skeleton = _meta_model(self.config, self.dtype)
        _register_attention()
        skeleton.config._attn_implementation = ATTENTION  # the layers' attention modules read this config
        # a CPU's choice, measured once per thread count (a GPU keeps half precision)
        setattr(skeleton.config, IN_FLOAT32, self.device.type == "cpu" and attention_in_float32(self.dtype))
        setattr(skeleton.config, INVARIANT, self.device.type == "cpu" and invariance_applies(self.dtype, quantization))
        all_layers = _get(skeleton, self.family.layers_path)
        self.blocks = nn.ModuleDict({str(i): all_layers[i] for i in range(layers.start, layers.end)})
        #: the decoder layers' name for their cache: ``cache`` from transformers 5.20, ``past_key_values`` before
        self._cache_kwarg = "cache" if "cache" in inspect.signature(type(all_layers[0]).forward).parameters \
            else "past_key_values"
        #: each sliding-window layer's window, as its attention module passes it: a session's cache
        #: keeps only that many positions of the layer
        self._windows = {i: w for i in range(layers.start, layers.end) if (w := _window(all_layers[i], self.config))}
        self.embed = self.norm = self.pos_embed = self.lm_head = None
        self.tokenizer = None
        prefixes = {f"{self.family.layers_path}.{i}.": f"blocks.{i}." for i in range(layers.start, layers.end)}
        if self.is_entry:
            self.embed = _get(skeleton, self.family.embed_path)
            self.norm = _get(skeleton, self.family.norm_path)
            self.lm_head = skeleton.get_output_embeddings()
            prefixes.update({f"{self.family.embed_path}.": "embed.", f"{self.family.norm_path}.": "norm.",
                             "lm_head.": "lm_head."})
            if self.family.pos_embed_path:
                self.pos_embed = _get(skeleton, self.family.pos_embed_path)
                prefixes[f"{self.family.pos_embed_path}."] = "pos_embed."
        self.rotary = None
        if self.family.rotary_path:
            rotary_cls = type(_get(skeleton, self.family.rotary_path))
            self.rotary = rotary_cls(config=self.config)
        self._load_tensors(prefixes)
        del skeleton
        self.quantization = quantization
        self._place(quantization)
        if self.is_entry:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        trim_heap()  # the load's casts and copies (and quantization's) are freed; give the pages back

    def _place(self, quantization: str) -> None:
        """Quantize the loaded layers (a quantized recipe, on the shard's device), or on the CPU give
        them and the head this host's fastest weight layout; then move what is left to a GPU."""
        gpu = self.device.type == "cuda"
        if quantization not in ("bfloat16", "float32"):
            from meshnet.models.quantize import quantize_shard
            self.lm_head = quantize_shard(self.blocks, self.lm_head, quantization, self.dtype, str(self.device))
        elif not gpu:  # the weight layout, and half-precision products in float32, that this host runs fastest
            apply_layouts(self.blocks)
            upcast_linears(self.blocks, min_rows(self.dtype))
            make_batch_invariant(self.blocks)
        if self.lm_head is not None and not gpu:  # an int4 head holds no nn.Linear: layouts pass it by
            tied = self.lm_head.weight is self.embed.weight
            if apply_layouts(self.lm_head).get("transposed") and tied:  # a tied lookup then reads strided values
                self.embed.weight = self.lm_head.weight
            # a packed head (ADR-0048) is a copy: the embeddings keep the plain weight for their lookups
            make_batch_invariant(self.lm_head)
        if gpu:
            for module in (*self._modules().values(), self.rotary):
                if module is not None:
                    module.to(self.device)

    def _modules(self) -> dict[str, nn.Module | None]:
        return {"blocks": self.blocks, "embed": self.embed, "norm": self.norm,
                "pos_embed": self.pos_embed, "lm_head": self.lm_head}

    def _load_tensors(self, prefixes: dict[str, str]) -> None:
        with Checkpoint(self.model_path, self.config) as checkpoint:
            wanted: dict[str, str] = {}
            for key in checkpoint.names():
                for src, dst in prefixes.items():
                    if key.startswith(src):
                        name = dst + key[len(src):]
                        for stored, module_name in self.family.renames:
                            name = name.replace(f".{stored}", f".{module_name}", 1)
                        wanted[key] = name
            for module in self._modules().values():
                if module is not None:
                    module.to_empty(device="cpu")
            params = {}
            for name, module in self._modules().items():
                if module is not None:
                    params.update({f"{name}.{k}": v for k, v in module.state_dict(keep_vars=True).items()})
            loaded: set[str] = set()
            for key, name in wanted.items():
                target = params.get(name)
                if target is not None:
                    with torch.no_grad():
                        target.copy_(checkpoint.tensor(key))  # casts in place: no second temporary
                    loaded.add(name)
            if self.family.experts is not None:
                stack_experts(checkpoint, self.family, self.config, self.layers, params, loaded)
            dequantize_mxfp4(checkpoint, wanted, params, loaded)
        if self.lm_head is not None and "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed.weight  # tied embeddings
            loaded.add("lm_head.weight")
        missing = sorted(k for k in params if k not in loaded and not k.endswith(("attn.bias", "masked_bias")))
        if missing:
            raise ModelSourceError(f"shard {self.layers} of {self.model_path}: missing tensors {missing[:5]}")
        if hasattr(self.embed, "scalar_embed_scale"):  # a non-persistent buffer, emptied above (Gemma)
            self.embed.embed_scale = torch.tensor(self.embed.scalar_embed_scale)
        for module in self._modules().values():
            if module is not None:
                module.eval()

    # ---- compute -------------------------------------------------------------------

    @torch.inference_mode()
    def embed_tokens(self, input_ids: torch.Tensor, position: int | list[int]) -> torch.Tensor:
        """Token ids ``[batch, seq]`` (int64) → hidden states ``[batch, seq, hidden]`` (compute dtype).

        ``position``: absolute position of ``input_ids[:, 0]``, one for all rows or one per row.

        Raises:
            InvalidRequest: this shard holds no embeddings (not an entry shard).
        """
        if self.embed is None:
            raise InvalidRequest("this shard holds no embeddings (not an entry shard)")
        hidden = self.embed(input_ids.to(self.device))
        if self.pos_embed is not None:
            hidden = hidden + self.pos_embed(position_ids(position, input_ids.shape[1]).to(self.device))
        return hidden.cpu()

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, cache: KVCache, position: int,
                layers: LayerRange | None = None) -> torch.Tensor:
        """Run decoder layers ``layers`` (default: the whole shard) on ``hidden`` of one session.

        Args:
            hidden: ``[batch, seq, hidden_size]``; cast to the compute dtype.
            cache: the session's KV cache; ``position`` must equal its cached length.
            position: absolute position of ``hidden[:, 0]`` (RoPE / learned offset).

        Returns:
            ``[batch, seq, hidden_size]`` in the compute dtype.
        """
        seq = hidden.shape[1]
        return self._run_layers(hidden, cache, position_ids(position, seq), causal_mask(seq, position, self.dtype),
                                self.layers if layers is None else layers)

    @torch.inference_mode()
    def forward_batch(self, hidden: torch.Tensor, caches: list[KVCache], positions: list[int],
                      layers: LayerRange | None = None) -> torch.Tensor:
        """One decode step of several sessions at once (ADR-0052).

        Args:
            hidden: ``[sessions, 1, hidden_size]``, row ``b`` the next token of session ``b``.
            caches: each row's own KV cache; ``positions[b]`` must equal ``caches[b]``'s length
                (the rows' lengths may all differ).

        Returns:
            ``[sessions, 1, hidden_size]`` in the compute dtype; row ``b`` equals
            ``forward(hidden[b:b+1], caches[b], positions[b])`` up to the matmul kernels' rounding.

        Raises:
            InvalidRequest: more than one token per row, or ``caches``/``positions`` not one per row.
        """
        if hidden.dim() != 3 or hidden.shape[1] != 1 or not len(caches) == len(positions) == hidden.shape[0]:
            raise InvalidRequest(f"a batched decode step takes [sessions, 1, hidden] with one cache and one "
                                 f"position per row, got {list(hidden.shape)}, {len(caches)} caches, "
                                 f"{len(positions)} positions")
        with sessions_apart([1] * len(caches)):
            return self._run_layers(hidden, BatchCache(caches), position_ids(positions, 1), None,
                                    self.layers if layers is None else layers)

    @torch.inference_mode()
    def forward_packed(self, hidden: torch.Tensor, caches: list[KVCache], positions: list[int],
                       q_lens: list[int], layers: LayerRange | None = None) -> torch.Tensor:
        """Steps of several sessions of one or a few positions each (decode and speculative steps,
        ADR-0058) as one packed row: every linear layer runs once over all the positions, the
        attention of each session's span over its own cache (:class:`PackedCache`).

        Args: ``hidden`` ``[1, sum(q_lens), hidden_size]``, session ``b``'s ``q_lens[b]`` positions in
        turn; ``caches`` each session's KV cache, ``positions[b]`` equal to ``caches[b]``'s length.

        Returns ``[1, sum(q_lens), hidden_size]`` (compute dtype); session ``b``'s span equals
        ``forward`` of that span alone up to the matmul kernels' rounding.

        Raises:
            InvalidRequest: the spans do not fill ``hidden``, or a cache or position is missing.
        """
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] != sum(q_lens) \
                or not len(caches) == len(positions) == len(q_lens):
            raise InvalidRequest(f"a packed step takes [1, sum of spans, hidden] with one cache and one position per "
                                 f"span, got {list(hidden.shape)}, spans {q_lens}, {len(caches)} caches, "
                                 f"{len(positions)} positions")
        ids = torch.cat([torch.arange(p, p + q) for p, q in zip(positions, q_lens)])[None]
        with sessions_apart(q_lens):
            return self._run_layers(hidden, PackedCache(caches, q_lens, positions), ids, None,
                                    self.layers if layers is None else layers)

    def _run_layers(self, hidden: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor | None,
                    layers: LayerRange) -> torch.Tensor:
        hidden = hidden.to(self.device, self.dtype)
        positions = positions.to(self.device)
        mask = None if mask is None else mask.to(self.device)
        if self._windows:  # the sessions' caches keep only the windows of these layers
            for session in getattr(cache, "caches", (cache,)):
                session.windows = self._windows
        kwargs, by_type = {self._cache_kwarg: cache}, None
        if self.rotary is not None and self.family.rotary_by_layer_type:
            types = self.config.layer_types
            by_type = {t: self.rotary(hidden, positions, t) for t in {types[i] for i in range(layers.start, layers.end)}}
            kwargs["position_ids"] = positions
        elif self.rotary is not None:
            axes = self.family.rotary_axes
            kwargs["position_embeddings"] = self.rotary(hidden, positions if axes == 1 else positions.expand(axes, -1, -1))
            kwargs["position_ids"] = positions
        for i in range(layers.start, layers.end):
            if by_type is not None:
                kwargs["position_embeddings"] = by_type[self.config.layer_types[i]]
            out = self.blocks[str(i)](hidden, attention_mask=None if i in self._linear else mask, use_cache=True,
                                      **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden.cpu()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``[batch, seq, hidden]`` → ``[batch, seq, vocab]`` float32, soft-capped
        as ``cap · tanh(logits / cap)`` where the config sets ``final_logit_softcapping`` (Gemma)."""
        if self.lm_head is None:
            raise InvalidRequest("this shard holds no LM head (not an entry shard)")
        logits = self.lm_head(self.norm(hidden.to(self.device, self.dtype))).float()
        cap = getattr(self.config, "final_logit_softcapping", None)
        return (logits if not cap else torch.tanh(logits / cap) * cap).cpu()

    def weight_bytes(self) -> int:
        """Resident bytes of this shard's weights (layers plus head when loaded)."""
        seen, total = set(), 0
        for module in self._modules().values():
            if module is None:
                continue
            for t in (*module.parameters(), *module.buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
                    state = getattr(t, "quant_state", None)  # nf4 absmax blocks
                    if state is not None and getattr(state, "absmax", None) is not None:
                        total += state.absmax.numel() * state.absmax.element_size()
        return total
