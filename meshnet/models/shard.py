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
import json
import logging
from pathlib import Path

import torch
from torch import nn

from meshnet.errors import InvalidRequest, ModelSourceError
from meshnet.layers import LayerRange
from meshnet.models.families import family_of
from meshnet.models.hosttimings import KEPT, remembered
from meshnet.models.linears import apply_layouts, layout, min_rows, per_thread_count, upcast_linears

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: tokens a KV-cache buffer grows by when it is full (ADR-0041): one copy of the cache every this many tokens
KV_BLOCK_TOKENS = 128


class KVCache:
    """Per-session key/value cache for the layers of one shard, stored without per-token copies.

    Duck-types the ``update(key, value, layer_idx, ...)`` call transformers' attention modules
    make. Per layer it holds one buffer each for keys and values, ``[batch, kv_heads, capacity,
    head_dim]`` in the compute dtype, of which the first ``lengths[layer]`` positions are filled.
    The first update sizes the buffers to its own tokens; when a later update does not fit, the
    buffers are reallocated with room for ``block_tokens`` more positions and the filled part is
    copied once. A decode step therefore writes one position in place, and the cache is
    copied once every ``block_tokens`` tokens, never once per token.

    Args:
        block_tokens: positions added when a buffer grows (> 0).
    """

    def __init__(self, block_tokens: int = KV_BLOCK_TOKENS) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = block_tokens
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: dict[int, int] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[batch, kv_heads, seq, head_dim]`` to layer
        ``layer_idx``; returns every cached key and value of that layer (views, no copy)."""
        length = self.lengths.get(layer_idx)
        if length is None:  # exactly the first chunk's size: a one-shot prefill leaves no slack
            keys = self.keys[layer_idx] = key_states.clone(memory_format=torch.contiguous_format)
            values = self.values[layer_idx] = value_states.clone(memory_format=torch.contiguous_format)
            self.lengths[layer_idx] = key_states.shape[-2] if key_states.dim() > 1 else key_states.numel()
            return keys, values
        new = key_states.shape[-2]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if length + new > keys.shape[-2]:
            keys, values = self._grow(layer_idx, length, length + new)
        keys[..., length:length + new, :].copy_(key_states)
        values[..., length:length + new, :].copy_(value_states)
        self.lengths[layer_idx] = length = length + new
        return keys[..., :length, :], values[..., :length, :]

    def _grow(self, layer_idx: int, length: int, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = needed + self.block_tokens
        grown = []
        for store in (self.keys, self.values):
            old = store[layer_idx]
            buffer = old.new_empty((*old.shape[:-2], capacity, old.shape[-1]))
            buffer[..., :length, :].copy_(old[..., :length, :])
            store[layer_idx] = buffer
            grown.append(buffer)
        return grown[0], grown[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached for layer ``layer_idx`` (0 when it holds none)."""
        return self.lengths.get(layer_idx, 0)

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys' and values' buffers, the room for later tokens included: what
        the session costs in memory (the session cache cap counts this, ADR-0031)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


def causal_mask(q_len: int, past_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive attention mask ``[1, 1, q_len, past_len + q_len]`` (0 = attend, min = blocked).

    Returns None where SDPA needs no mask: a single query token (it attends to everything
    cached) and a chunk at position 0 (SDPA's own ``is_causal`` path, which builds nothing).
    """
    if q_len == 1 or past_len == 0:
        return None
    q_pos = torch.arange(past_len, past_len + q_len)[:, None]
    k_pos = torch.arange(past_len + q_len)[None, :]
    mask = torch.zeros(q_len, past_len + q_len, dtype=dtype)
    mask.masked_fill_(k_pos > q_pos, torch.finfo(dtype).min)
    return mask[None, None]


class RaggedKV:
    """Keys (or values) of a batch whose rows have different lengths: ``rows[b]`` is row ``b``'s
    own cached tensor ``[1, kv_heads, length_b, head_dim]`` (a view of its session's buffer)."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows


class BatchCache:
    """The KV caches of a batch of sessions, one per row, seen as one cache by the attention modules.

    ``update`` writes row ``b`` of the new keys and values into ``caches[b]`` (in place, see
    :class:`KVCache`) and returns :class:`RaggedKV` views that :func:`attention` runs row by row.
    """

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[RaggedKV, RaggedKV]:
        keys, values = [], []
        for row, cache in enumerate(self.caches):
            k, v = cache.update(key_states[row:row + 1], value_states[row:row + 1], layer_idx)
            keys.append(k)
            values.append(v)
        return RaggedKV(keys), RaggedKV(values)


#: name of meshnet's attention function in transformers' AttentionInterface
ATTENTION = "meshnet_sdpa"
_sdpa = None  # transformers' SDPA attention function, bound by _register_attention


def attention(module: nn.Module, query: torch.Tensor, key, value, attention_mask: torch.Tensor | None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; a ragged batch (:class:`RaggedKV` keys and values) runs one
    SDPA per row over that row's own cache, with no mask and no padding, so every row computes
    exactly what it computes alone.

    A single query token with no mask (every decode step, batched or not) calls torch's SDPA
    directly (:func:`decode_attention`): the same kernel and the same result as transformers'
    wrapper, without its per-call Python checks.

    Args:
        query: ``[batch, heads, q_len, head_dim]`` (``q_len == 1`` for a ragged batch).

    Returns:
        ``([batch, q_len, heads, head_dim], None)``.
    """
    scale = kwargs.get("scaling")
    in_float32 = getattr(module.config, IN_FLOAT32, False)
    window = kwargs.pop("sliding_window", None)
    if isinstance(key, RaggedKV):
        rows = [decode_attention(query[b:b + 1], *_last(k, v, window), scale, in_float32)
                for b, (k, v) in enumerate(zip(key.rows, value.rows))]
        return torch.cat(rows).transpose(1, 2), None
    if window is not None:
        if query.shape[2] == 1:  # one query: the window is the last ``window`` keys
            key, value = _last(key, value, window)
        else:
            attention_mask = sliding_mask(attention_mask, query.shape[2], key.shape[2], window, query.dtype)
    if query.shape[2] == 1 and attention_mask is None and not module.training and kwargs.get("softcap") is None:
        return decode_attention(query, key, value, scale, in_float32).transpose(1, 2), None
    return _sdpa(module, query, key, value, attention_mask, **kwargs)


def _last(key: torch.Tensor, value: torch.Tensor, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``window`` cached positions of ``key`` and ``value`` ``[.., length, head_dim]``
    (all of them with no window): what a decode step's query attends to in a sliding layer."""
    if window is None or key.shape[-2] <= window:
        return key, value
    return key[..., -window:, :], value[..., -window:, :]


def sliding_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, window: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[1, 1, q_len, kv_len]`` of a sliding-window layer: ``mask`` (the
    shard's causal mask; None: causal) with every key at or before ``q - window`` blocked too,
    for the query at absolute position ``q`` (the queries are the last ``q_len`` of ``kv_len``
    positions). transformers' rule: a query attends to keys in ``(q - window, q]``."""
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    blocked = (k_pos > q_pos) | (k_pos <= q_pos - window)
    out = torch.zeros(q_len, kv_len, dtype=dtype).masked_fill_(blocked, torch.finfo(dtype).min)[None, None]
    return out if mask is None else torch.minimum(out, mask.to(dtype))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float | None, in_float32: bool = False) -> torch.Tensor:
    """One query token attending to every cached position: torch's SDPA with no mask.

    Args:
        query: ``[batch, heads, 1, head_dim]``.
        key, value: ``[batch, kv_heads, length, head_dim]``; ``heads`` a multiple of ``kv_heads``
            (grouped-query attention runs on the key/value heads as stored, no repeat).
        scale: the softmax scale (None: ``1 / sqrt(head_dim)``).
        in_float32: a half-precision query, keys and values are cast to float32 and the output
            rounded once back (:func:`attention_in_float32` chose it for this host; ADR-0047).

    Returns:
        ``[batch, heads, 1, head_dim]`` in the query's dtype.

    transformers' ``sdpa_attention_forward`` makes this same call for a decode step (no mask,
    ``enable_gqa``) after Python checks that cost as much as the kernel itself at a short context,
    so a decode step calls the kernel directly (ADR-0041's attention amendment).
    """
    gqa = query.shape[1] != key.shape[1]
    if in_float32 and query.dtype != torch.float32:  # this host's half kernel is slower than casting (ADR-0047)
        return torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), scale=scale, enable_gqa=gqa).to(query.dtype)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=gqa)


#: the attribute of a shard's model config that says its decode attention runs in float32
#: (:func:`attention_in_float32`, set at load; the layers' attention modules share the config)
IN_FLOAT32 = "meshnet_attention_in_float32"
#: cached lengths a decode step's attention is timed at: a short chat, and a long one
ATTENTION_LENGTHS = (128, 1024)
#: query heads, key-value heads and head size of the timed attention (SmolLM2-135M's grouping of
#: 3 query heads per key-value head, at the head size most Llama-style models use)
ATTENTION_SHAPE = (9, 3, 64)


@per_thread_count
def attention_in_float32(dtype: torch.dtype) -> bool:
    """Whether this process runs a half-precision decode step's attention in float32: the query,
    keys and values cast up, torch's SDPA in float32, the output rounded once back to ``dtype``.

    Measured once per host, dtype and thread count (:func:`measure_attention`, kept as
    :func:`meshnet.models.linears.layout` keeps its timings): chosen when the float32 path is at
    least :data:`meshnet.models.linears.MIN_GAIN` times as fast as the half kernel at every length
    timed. A CPU without native bfloat16 runs the cast float32 path several times faster
    (ADR-0047's attention amendment gives the figures); where the CPU computes bfloat16 natively
    the half kernel may win, and is kept. False for float32, and where ``MESHNET_UPCAST_MIN_ROWS=off``
    keeps every product in half precision (ADR-0047).
    """
    from meshnet.models.linears import HALF, MIN_GAIN, upcast_off

    if dtype not in HALF or upcast_off():
        return False
    name = str(dtype).removeprefix("torch.")

    def timed() -> bool:
        samples = measure_attention(dtype)
        chosen = all(half >= MIN_GAIN * upcast for half, upcast in samples.values())
        log.info("%s decode attention runs in %s (half / float32 path µs by cached length: %s)", name,
                 "float32" if chosen else "half precision",
                 ", ".join(f"{n}: {h * 1e6:.0f}/{u * 1e6:.0f}" for n, (h, u) in samples.items()))
        return chosen

    chosen, measured = remembered(f"attention in float32|{name}|threads {torch.get_num_threads()}", timed,
                                  valid=lambda value: isinstance(value, bool))
    if not measured:
        log.info("%s decode attention runs in %s (this host's timing, %s)", name,
                 "float32" if chosen else "half precision", KEPT)
    return chosen


def measure_attention(dtype: torch.dtype, lengths: tuple[int, ...] = ATTENTION_LENGTHS, calls: int = 50,
                      repeats: int = 5) -> dict[int, tuple[float, float]]:
    """Seconds per decode-step attention call in ``dtype``, at each cached length: ``(half kernel,
    float32 path)``, medians of ``repeats`` interleaved passes of ``calls`` calls. Keys and values
    are views of a longer buffer, as a KV cache holds them (:data:`ATTENTION_SHAPE` heads)."""
    import statistics
    import time

    heads, kv_heads, head_dim = ATTENTION_SHAPE
    gen = torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for length in lengths:
            query = torch.randn(1, heads, 1, head_dim, generator=gen).to(dtype)
            key, value = (torch.randn(1, kv_heads, length + 64, head_dim, generator=gen).to(dtype)[..., :length, :]
                          for _ in range(2))
            paths = (lambda: sdpa(query, key, value, enable_gqa=True),
                     lambda: sdpa(query.float(), key.float(), value.float(), enable_gqa=True).to(dtype))
            times: list[list[float]] = [[], []]
            for i in range(repeats + 1):
                for path, into in zip(paths, times):
                    start = time.perf_counter()
                    for _ in range(calls):
                        path()
                    if i:  # the first pass warms both
                        into.append((time.perf_counter() - start) / calls)
            out[length] = (statistics.median(times[0]), statistics.median(times[1]))
    return out


def _register_attention() -> None:
    global _sdpa
    if _sdpa is None:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _sdpa = sdpa_attention_forward
        AttentionInterface.register(ATTENTION, attention)


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


def _tensor_index(model_path: Path) -> dict[str, Path]:
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: model_path / name for key, name in weight_map.items()}
    from safetensors import safe_open
    out = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as fh:
            out.update({key: file for key in fh.keys()})
    return out


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The whole model of ``config`` on the ``meta`` device (shapes only, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


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
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
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
            weights in the compute dtype), ``int8`` or ``nf4`` (bitsandbytes, see quantize.py).

    Raises:
        ModelSourceError: missing tensors or a range beyond the model's layer count.
    """

    def __init__(self, model_path: Path, layers: LayerRange, *, dtype: str = "float32",
                 load_head: bool | None = None, quantization: str = "bfloat16") -> None:
        from transformers import AutoConfig

        self.model_path = Path(model_path)
        self.config = AutoConfig.from_pretrained(self.model_path)
        self.config._attn_implementation = "sdpa"
        self.num_layers = int(self.config.num_hidden_layers)
        if layers.end > self.num_layers:
            raise ModelSourceError(f"shard {layers} beyond the model's {self.num_layers} layers")
        self.layers = layers
        self.dtype = DTYPES[dtype]
        self.family = family_of(self.config)
        self.is_entry = layers.start == 0 if load_head is None else load_head
        skeleton = _meta_model(self.config, self.dtype)
        _register_attention()
        skeleton.config._attn_implementation = ATTENTION  # the layers' attention modules read this config
        setattr(skeleton.config, IN_FLOAT32, attention_in_float32(self.dtype))  # measured once per thread count
        all_layers = _get(skeleton, self.family.layers_path)
        self.blocks = nn.ModuleDict({str(i): all_layers[i] for i in range(layers.start, layers.end)})
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
        if quantization not in ("bfloat16", "float32"):
            from meshnet.models.quantize import quantize_linears
            quantize_linears(self.blocks, quantization, self.dtype)
        else:  # the weight layout, and half-precision products in float32, that this host runs fastest
            apply_layouts(self.blocks)
            upcast_linears(self.blocks, min_rows(self.dtype))
        if self.lm_head is not None:
            tied = self.lm_head.weight is self.embed.weight
            if apply_layouts(self.lm_head).get("transposed") and tied:  # a tied lookup then reads strided values
                self.embed.weight = self.lm_head.weight
            # a packed head (ADR-0048) is a copy: the embeddings keep the plain weight for their lookups
        if self.is_entry:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        trim_heap()  # the load's casts and copies (and quantization's) are freed; give the pages back

    def _modules(self) -> dict[str, nn.Module | None]:
        return {"blocks": self.blocks, "embed": self.embed, "norm": self.norm,
                "pos_embed": self.pos_embed, "lm_head": self.lm_head}

    def _load_tensors(self, prefixes: dict[str, str]) -> None:
        from safetensors import safe_open

        index = _tensor_index(self.model_path)
        wanted: dict[str, str] = {}
        for key in index:
            for src, dst in prefixes.items():
                if key.startswith(src):
                    wanted[key] = dst + key[len(src):]
        for module in self._modules().values():
            if module is not None:
                module.to_empty(device="cpu")
        params = {}
        for name, module in self._modules().items():
            if module is not None:
                params.update({f"{name}.{k}": v for k, v in module.state_dict(keep_vars=True).items()})
        loaded: set[str] = set()
        by_file: dict[Path, list[str]] = {}
        for key in wanted:
            by_file.setdefault(index[key], []).append(key)
        for file, keys in by_file.items():
            with safe_open(file, framework="pt") as fh:
                for key in keys:
                    target = params.get(wanted[key])
                    if target is not None:
                        with torch.no_grad():
                            target.copy_(fh.get_tensor(key))  # casts in place: no second temporary
                        loaded.add(wanted[key])
        if self.lm_head is not None and "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed.weight  # tied embeddings
            loaded.add("lm_head.weight")
        missing = sorted(k for k in params if k not in loaded and not k.endswith(("attn.bias", "masked_bias")))
        if missing:
            raise ModelSourceError(f"shard {self.layers} of {self.model_path}: missing tensors {missing[:5]}")
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
        hidden = self.embed(input_ids)
        if self.pos_embed is not None:
            hidden = hidden + self.pos_embed(position_ids(position, input_ids.shape[1]))
        return hidden

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
                                layers or self.layers)

    @torch.inference_mode()
    def forward_batch(self, hidden: torch.Tensor, caches: list[KVCache], positions: list[int],
                      layers: LayerRange | None = None) -> torch.Tensor:
        """One decode step of several sessions at once (ADR-0041).

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
        return self._run_layers(hidden, BatchCache(caches), position_ids(positions, 1), None, layers or self.layers)

    def _run_layers(self, hidden: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor | None,
                    layers: LayerRange) -> torch.Tensor:
        hidden = hidden.to(self.dtype)
        kwargs = {}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden, positions)
            kwargs["position_ids"] = positions
        for i in range(layers.start, layers.end):
            out = self.blocks[str(i)](hidden, attention_mask=mask, cache=cache, use_cache=True, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``[batch, seq, hidden]`` → ``[batch, seq, vocab]`` float32."""
        if self.lm_head is None:
            raise InvalidRequest("this shard holds no LM head (not an entry shard)")
        return self.lm_head(self.norm(hidden.to(self.dtype))).float()

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
