"""Shard exactness (meshnet.models.shard): tiny seeded models, float32, against transformers' own forward."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from meshnet.node import wire
from meshnet.errors import InvalidRequest, ModelSourceError
from meshnet.layers import LayerRange
from meshnet.models import kernels, linears
from meshnet.models.caches import KVCache, causal_mask
from meshnet.models.shard import ShardModel

FAMILIES = ["tiny-llama", "tiny-gpt2"]
NUM_LAYERS = 4


def token_ids(n: int, seed: int = 0) -> torch.Tensor:
    """``[1, n]`` token ids drawn from the byte range of the tiny vocabulary (512)."""
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def over_wire(hidden: torch.Tensor) -> torch.Tensor:
    return wire.decode(wire.encode(hidden, dtype="float32"))


def reference_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(ids).logits.float()


def run_split(entry: ShardModel, tail: ShardModel | None, ids: torch.Tensor, position: int,
              caches: tuple[KVCache, KVCache]) -> torch.Tensor:
    """Embed on ``entry``, its layers, the wire, ``tail``'s layers, then the entry's head."""
    hidden = entry.forward(entry.embed_tokens(ids, position), caches[0], position)
    if tail is not None:
        hidden = over_wire(tail.forward(over_wire(hidden), caches[1], position))
    return entry.logits(hidden)


@pytest.mark.parametrize("name", FAMILIES)
def test_unsplit_shard_equals_transformers(name, tiny_shard, tiny_hf_model):
    ids = token_ids(12)
    shard = tiny_shard(name, 0, NUM_LAYERS)
    assert shard.is_entry and shard.num_layers == NUM_LAYERS
    logits = run_split(shard, None, ids, 0, (KVCache(), KVCache()))
    assert logits.shape == (1, 12, 512)
    assert_close(logits, reference_logits(tiny_hf_model(name), ids))


@pytest.mark.parametrize("k", range(1, NUM_LAYERS))
@pytest.mark.parametrize("name", FAMILIES)
def test_split_at_every_boundary_equals_transformers(name, k, tiny_shard, tiny_hf_model):
    ids = token_ids(12, seed=k)
    entry, tail = tiny_shard(name, 0, k), tiny_shard(name, k, NUM_LAYERS)
    assert entry.is_entry and not tail.is_entry
    logits = run_split(entry, tail, ids, 0, (KVCache(), KVCache()))
    assert_close(logits, reference_logits(tiny_hf_model(name), ids))


@pytest.mark.parametrize("split_at", [NUM_LAYERS, 2], ids=["unsplit", "split-at-2"])
@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_then_decode_equals_full_forward(name, split_at, tiny_shard, tiny_hf_model):
    ids = token_ids(15, seed=7)
    expected = reference_logits(tiny_hf_model(name), ids)
    entry = tiny_shard(name, 0, split_at)
    tail = tiny_shard(name, split_at, NUM_LAYERS) if split_at < NUM_LAYERS else None
    caches = (KVCache(), KVCache())
    prefill = run_split(entry, tail, ids[:, :10], 0, caches)
    assert_close(prefill, expected[:, :10])
    for position in range(10, 15):
        step = run_split(entry, tail, ids[:, position:position + 1], position, caches)
        assert step.shape == (1, 1, 512)
        assert_close(step, expected[:, position:position + 1])
    assert caches[0].get_seq_length(0) == 15
    if tail is not None:
        assert caches[1].get_seq_length(split_at) == 15


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_equals_one_shot(name, tiny_shard):
    ids = token_ids(15, seed=3)
    shard = tiny_shard(name, 0, NUM_LAYERS)
    one_shot = shard.forward(shard.embed_tokens(ids, 0), KVCache(), 0)
    cache, chunks = KVCache(), []
    for position in range(0, 15, 4):  # chunks of 4, 4, 4 and 3 tokens
        chunk = ids[:, position:position + 4]
        chunks.append(shard.forward(shard.embed_tokens(chunk, position), cache, position))
    chunked = torch.cat(chunks, dim=1)
    assert chunked.shape == one_shot.shape == (1, 15, 64)
    assert_close(chunked, one_shot)
    assert_close(shard.logits(chunked), shard.logits(one_shot))


@pytest.mark.parametrize("name", FAMILIES)
def test_sub_range_of_a_shard_runs_only_those_layers(name, tiny_shard):
    """A hop may start inside a shard (ADR-0012): layers [2,4) of a [0,4) shard equal a [2,4) shard."""
    ids = token_ids(6, seed=11)
    full, tail = tiny_shard(name, 0, NUM_LAYERS), tiny_shard(name, 2, NUM_LAYERS)
    hidden = full.forward(full.embed_tokens(ids, 0), KVCache(), 0, LayerRange(0, 2))
    assert_close(full.forward(hidden, KVCache(), 0, LayerRange(2, 4)), tail.forward(hidden, KVCache(), 0))


@pytest.mark.parametrize("name", FAMILIES)
def test_middle_shard_holds_no_head(name, tiny_shard):
    middle, full = tiny_shard(name, 1, 3), tiny_shard(name, 0, NUM_LAYERS)
    assert not middle.is_entry
    assert middle.embed is None and middle.lm_head is None and middle.norm is None
    assert middle.tokenizer is None
    assert sorted(middle.blocks.keys()) == ["1", "2"]
    assert 0 < middle.weight_bytes() < full.weight_bytes()
    with pytest.raises(InvalidRequest, match="holds no embeddings"):
        middle.embed_tokens(token_ids(2), 0)
    with pytest.raises(InvalidRequest, match="holds no LM head"):
        middle.logits(torch.zeros(1, 1, 64))


def test_weight_bytes_of_tiny_llama_is_exact(tiny_shard):
    # per layer: q 64x64, k/v 64x32 each, o 64x64, mlp 3 x 64x128, two norms of 64 -> 41,088 params
    per_layer = (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) * 4
    head = (512 * 64 + 64) * 4  # tied embedding/LM head counted once, plus the final norm
    assert tiny_shard("tiny-llama", 1, 3).weight_bytes() == 2 * per_layer
    assert tiny_shard("tiny-llama", 0, 4).weight_bytes() == 4 * per_layer + head


def test_load_head_forces_the_head_on_a_later_range(tiny_shard):
    shard = tiny_shard("tiny-llama", 2, 4, load_head=True)
    assert shard.is_entry and shard.lm_head is not None and shard.tokenizer is not None


@pytest.mark.parametrize("name", FAMILIES)
def test_layers_beyond_the_model_raise(name, tiny_model_path):
    with pytest.raises(ModelSourceError, match=r"shard 2-4 beyond the model's 4 layers"):
        ShardModel(tiny_model_path(name), LayerRange(2, 5))


def test_directory_without_weights_raises(tmp_path, tiny_model_path):
    (tmp_path / "config.json").write_text((tiny_model_path("tiny-llama") / "config.json").read_text())
    with pytest.raises(ModelSourceError, match="missing tensors"):
        ShardModel(tmp_path, LayerRange(1, 3))


def test_causal_mask_shapes_and_values():
    assert causal_mask(1, 5, torch.float32) is None
    assert causal_mask(4, 0, torch.float32) is None  # a first chunk: SDPA's is_causal, no mask built
    mask = causal_mask(3, 2, torch.float32)
    assert mask.shape == (1, 1, 3, 5)
    blocked = mask[0, 0] != 0
    assert blocked.tolist() == [[False, False, False, True, True],
                                [False, False, False, False, True],
                                [False, False, False, False, False]]


def test_kv_cache_appends_along_sequence():
    cache = KVCache(block_tokens=4)
    k, v = torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, 4)
    cache.update(k, v, 5)
    assert cache.nbytes == 2 * 1 * 2 * 3 * 4 * 4  # the first chunk is held at its own size
    keys, values = cache.update(k, v, 5)
    assert keys.shape == values.shape == (1, 2, 6, 4)
    assert keys[:, :, :3].eq(0).all() and values.eq(1).all()
    assert cache.get_seq_length(5) == 6 and cache.get_seq_length(0) == 0
    assert cache.nbytes == 2 * 1 * 2 * (6 + 4) * 4 * 4  # grown by one block: the room counts


def test_kv_cache_writes_decode_tokens_in_place_and_copies_once_per_block():
    cache = KVCache(block_tokens=8)
    cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
    buffers = set()
    for step in range(1, 17):
        token = torch.full((1, 2, 1, 4), float(step))
        keys, values = cache.update(token, token.clone(), 0)
        assert keys.shape == (1, 2, 5 + step, 4) and keys[0, 0, -1, 0] == step
        buffers.add(cache.keys[0].data_ptr())
    assert len(buffers) == 2  # grown to 6 + 8 = 14 positions at step 1, to 15 + 8 = 23 at step 10
    assert cache.keys[0].shape == (1, 2, 23, 4)
    assert cache.keys[0][0, 1, :21, 0].tolist() == [0.0] * 5 + [float(i) for i in range(1, 17)]
    assert cache.nbytes == 2 * 2 * 23 * 4 * 4


@pytest.mark.parametrize("name", FAMILIES)
def test_middle_shard_holds_only_its_layers_tensors(name, tiny_shard):
    # ADR-0039: nothing of the skeleton (embeddings, LM head, other layers) stays materialised
    middle = tiny_shard(name, 1, 3)
    modules = [v for v in vars(middle).values() if isinstance(v, torch.nn.Module)]
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    assert all(t.device.type == "cpu" for t in tensors)
    assert not any(512 in t.shape for t in tensors)   # no [vocab, hidden] tensor anywhere
    params = {id(p): p for m in modules for p in m.parameters()}
    assert sum(p.numel() * p.element_size() for p in params.values()) == middle.weight_bytes()


def test_trim_heap_runs_on_glibc_and_is_a_no_op_elsewhere():
    import platform

    from meshnet.models.shard import trim_heap

    assert trim_heap() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


@pytest.fixture
def fresh_attention(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHNET_HOST_TIMINGS", str(tmp_path / "host-timings.json"))  # nothing measured yet
    linears.attention_in_float32.cache_clear()
    yield monkeypatch
    linears.attention_in_float32.cache_clear()


def attention_inputs(dtype):
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2, 6, 1, 16, generator=gen).to(dtype)
    key, value = (torch.randn(2, 2, 40, 16, generator=gen).to(dtype)[..., :33, :] for _ in range(2))  # cache views
    return query, key, value


def test_half_decode_attention_in_float32_is_the_float32_result_rounded_once():
    query, key, value = attention_inputs(torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    half = kernels.decode_attention(query, key, value, None)
    assert torch.equal(half, sdpa(query, key, value, enable_gqa=True))  # not chosen: the half kernel
    cast = kernels.decode_attention(query, key, value, None, in_float32=True)
    want = sdpa(query.float(), key.float(), value.float(), enable_gqa=True).to(torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and cast.shape == (2, 6, 1, 16) and torch.equal(cast, want)
    assert torch.allclose(cast.float(), half.float(), rtol=2e-2, atol=1e-2)
    q32, k32, v32 = attention_inputs(torch.float32)
    for in_float32 in (False, True):
        want = sdpa(q32, k32, v32, enable_gqa=True)
        assert torch.equal(kernels.decode_attention(q32, k32, v32, None, in_float32), want)


@pytest.mark.parametrize("samples, chosen", [
    ({128: (154e-6, 41e-6), 1024: (1281e-6, 222e-6)}, True),   # 2-core AVX2 host, one thread (2026-12-01)
    ({128: (154e-6, 41e-6), 1024: (250e-6, 222e-6)}, False),   # a length where casting gains under MIN_GAIN
    ({128: (40e-6, 60e-6), 1024: (200e-6, 300e-6)}, False),    # native half kernels: kept
])
def test_decode_attention_runs_in_float32_only_where_that_wins_at_every_length(fresh_attention, samples, chosen):
    fresh_attention.setattr(linears, "measure_attention", lambda dtype: samples)
    assert linears.attention_in_float32(torch.bfloat16) is chosen


def test_float32_and_the_off_switch_measure_no_attention(fresh_attention):
    fresh_attention.setattr(linears, "measure_attention", lambda dtype: pytest.fail("measured"))
    assert linears.attention_in_float32(torch.float32) is False
    fresh_attention.setenv("MESHNET_UPCAST_MIN_ROWS", "off")
    assert linears.attention_in_float32(torch.bfloat16) is False


def test_measure_attention_times_both_paths_at_each_length():
    samples = linears.measure_attention(torch.bfloat16, lengths=(8, 32), calls=2, repeats=1)
    assert sorted(samples) == [8, 32] and all(h > 0 and u > 0 for h, u in samples.values())


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_a_shard_runs_its_decode_attention_as_its_host_timing_chose(fresh_attention, name, tiny_model_path):
    fresh_attention.setattr(linears, "measure_attention", lambda dtype: {128: (154e-6, 41e-6), 1024: (1281e-6, 222e-6)})
    calls = []
    real = kernels.decode_attention
    fresh_attention.setattr(kernels, "decode_attention", lambda *args: calls.append(args[-1]) or real(*args))
    half = ShardModel(tiny_model_path(name), LayerRange(0, 2), dtype="bfloat16")
    exact = ShardModel(tiny_model_path(name), LayerRange(0, 2), dtype="float32")
    for model in (half, exact):
        cache = KVCache()
        with torch.inference_mode():
            # a prompt longer than a speculative step (ADR-0064: those run position by position)
            model.forward(model.embed_tokens(torch.arange(3, 3 + kernels.INVARIANT_SPAN + 1)[None], 0), cache, 0)
            step = kernels.INVARIANT_SPAN + 1
            model.forward(model.embed_tokens(torch.tensor([[9]]), step), cache, step)
    assert calls == [True, True, False, False]  # two layers' decode step each: bfloat16 cast up, float32 as it is


def test_host_timings_are_kept_per_thread_count():
    measured = []

    @linears.per_thread_count
    def timing(dtype, shape):
        measured.append((dtype, shape, torch.get_num_threads()))
        return len(measured)

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert timing(torch.float32, (4, 4)) == 1 and timing(torch.float32, (4, 4)) == 1  # once per count
        torch.set_num_threads(2)
        assert timing(torch.float32, (4, 4)) == 2 and timing(torch.float32, (4, 4)) == 2
        torch.set_num_threads(1)
        assert timing(torch.float32, (4, 4)) == 1 and timing(torch.bfloat16, (4, 4)) == 3
        assert measured == [(torch.float32, (4, 4), 1), (torch.float32, (4, 4), 2), (torch.bfloat16, (4, 4), 1)]
        timing.cache_clear()
        assert timing(torch.float32, (4, 4)) == 4
    finally:
        torch.set_num_threads(previous)
