"""Batched decode (meshnet.models.shard.ShardModel.forward_batch): sessions of different lengths
run as one forward equal their solo runs, tiny seeded models, float32 (ADR-0041)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from meshnet.models.caches import KVCache

FAMILIES = ["tiny-llama", "tiny-gpt2"]
PROMPT_LENGTHS = [3, 11, 7, 1, 20]  # ragged on purpose: every session at its own position


def prompts(lengths: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (1, n), generator=gen) for n in lengths]


def prefill(shard, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return shard.forward(shard.embed_tokens(ids, 0), cache, 0)


def greedy_solo(shard, ids: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of one session alone, and the hidden state of each decode step."""
    cache = KVCache(block_tokens=4)  # small blocks: the test also crosses buffer growths
    token = int(shard.logits(prefill(shard, ids, cache))[0, -1].argmax())
    tokens, hiddens, position = [token], [], ids.shape[1]
    for _ in range(steps):
        hidden = shard.forward(shard.embed_tokens(torch.tensor([[token]]), position), cache, position)
        hiddens.append(hidden)
        token = int(shard.logits(hidden)[0, -1].argmax())
        tokens.append(token)
        position += 1
    return tokens, hiddens


def greedy_batched(shard, all_ids: list[torch.Tensor], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The same sessions, each prefilled alone, then every decode step of all of them as one batch."""
    caches = [KVCache(block_tokens=4) for _ in all_ids]
    tokens = [[int(shard.logits(prefill(shard, ids, c))[0, -1].argmax())] for ids, c in zip(all_ids, caches)]
    positions = [ids.shape[1] for ids in all_ids]
    hiddens = []
    for _ in range(steps):
        last = [t[-1] for t in tokens]
        embedded = shard.embed_tokens(torch.tensor(last)[:, None], positions)
        hidden = shard.forward_batch(embedded, caches, positions)
        hiddens.append(hidden)
        for row, token in enumerate(shard.logits(hidden)[:, -1].argmax(-1).tolist()):
            tokens[row].append(token)
        positions = [p + 1 for p in positions]
    assert [c.get_seq_length(0) for c in caches] == [n + steps for n in PROMPT_LENGTHS]
    return tokens, hiddens


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_decode_of_ragged_sessions_equals_each_solo_run(name, tiny_shard):
    shard = tiny_shard(name, 0, 4)
    all_ids = prompts(PROMPT_LENGTHS)
    steps = 9
    batched_tokens, batched_hiddens = greedy_batched(shard, all_ids, steps)
    for row, ids in enumerate(all_ids):
        solo_tokens, solo_hiddens = greedy_solo(shard, ids, steps)
        assert batched_tokens[row] == solo_tokens
        for step in range(steps):
            assert_close(batched_hiddens[step][row:row + 1], solo_hiddens[step], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_middle_shard_batches_a_sub_range(name, tiny_shard):
    """A hop starting inside a shard (ADR-0012) batches too: layers [2,4) of a [1,4) shard."""
    shard = tiny_shard(name, 1, 4)
    gen = torch.Generator().manual_seed(9)
    caches_batch, caches_solo, positions = [], [], []
    for n in (4, 9, 2):
        prompt = torch.randn(1, n, 64, generator=gen)
        for caches in (caches_batch, caches_solo):
            caches.append(KVCache())
            shard.forward(prompt, caches[-1], 0, LayerRange(2, 4))
        positions.append(n)
    step = torch.randn(3, 1, 64, generator=gen)
    out = shard.forward_batch(step, caches_batch, positions, LayerRange(2, 4))
    assert out.shape == (3, 1, 64)
    for row in range(3):
        solo = shard.forward(step[row:row + 1], caches_solo[row], positions[row], LayerRange(2, 4))
        assert_close(out[row:row + 1], solo, rtol=1e-5, atol=1e-5)
    assert caches_batch[0].get_seq_length(1) == 0 and caches_batch[0].get_seq_length(2) == 5


def test_batch_of_one_is_the_solo_forward(tiny_shard):
    shard = tiny_shard("tiny-llama", 0, 4)
    ids = prompts([6])[0]
    solo, batched = KVCache(), KVCache()
    prefill(shard, ids, solo)
    prefill(shard, ids, batched)
    step = shard.embed_tokens(torch.tensor([[42]]), 6)
    assert torch.equal(shard.forward_batch(step, [batched], [6]), shard.forward(step, solo, 6))


def test_forward_batch_takes_one_token_and_one_cache_per_row(tiny_shard):
    shard = tiny_shard("tiny-llama", 0, 4)
    with pytest.raises(InvalidRequest, match=r"takes \[sessions, 1, hidden\].*got \[2, 3, 64\]"):
        shard.forward_batch(torch.zeros(2, 3, 64), [KVCache(), KVCache()], [0, 0])
    with pytest.raises(InvalidRequest, match="1 caches, 2 positions"):
        shard.forward_batch(torch.zeros(2, 1, 64), [KVCache()], [0, 0])


@pytest.mark.parametrize("name", FAMILIES)
def test_decode_attention_is_transformers_sdpa_exactly(name, tiny_shard):
    """The direct decode call (meshnet.models.kernels.decode_attention) gives transformers' SDPA
    wrapper's output bit for bit: one query token, grouped heads (tiny-llama: 4 heads on 2
    key/value heads) or not (tiny-gpt2), with the module's own scale."""
    from meshnet.models import kernels as shard_module

    shard = tiny_shard(name, 0, 4)
    block = shard.blocks["0"]
    module = block.self_attn if name == "tiny-llama" else block.attn
    heads = shard.config.num_attention_heads
    kv_heads = getattr(shard.config, "num_key_value_heads", None) or heads
    head_dim = shard.config.hidden_size // heads
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, heads, 1, head_dim, generator=gen)
    key, value = (torch.randn(2, kv_heads, 13, head_dim, generator=gen) for _ in range(2))
    expected, _ = shard_module._sdpa(module, query, key, value, None, dropout=0.0, scaling=module.scaling)
    got, _ = shard_module.attention(module, query, key, value, None, dropout=0.0, scaling=module.scaling)
    assert got.shape == (2, 1, heads, head_dim)
    assert torch.equal(got, expected)
    ragged, _ = shard_module.attention(module, query, shard_module.RaggedKV([key[:1], key[1:, :, :7]]),
                                       shard_module.RaggedKV([value[:1], value[1:, :, :7]]), None, scaling=module.scaling)
    for row, (k, v) in enumerate([(key[:1], value[:1]), (key[1:, :, :7], value[1:, :, :7])]):  # each row alone
        alone, _ = shard_module._sdpa(module, query[row:row + 1], k, v, None, scaling=module.scaling)
        assert torch.equal(ragged[row:row + 1], alone)


@pytest.mark.parametrize("recipe", ["int8", "int4"])
def test_the_int_recipes_decode_a_row_the_same_whatever_the_batch(recipe, tiny_model_path):
    """torch's weight-only int8 and int4 kernels compute each row alone (ADR-0061, ADR-0062): batched
    bfloat16 decode steps equal the solo ones bit for bit, where a bfloat16 product's rounding may
    move with the batch's row count."""
    from meshnet.node.runtime import NodeRuntime
    runtime = NodeRuntime(compute_dtype="bfloat16")
    shard = runtime.load("tiny-llama", tiny_model_path("tiny-llama"), LayerRange(0, 4), quantization=recipe).shard
    all_ids = prompts(PROMPT_LENGTHS)
    batched_tokens, batched_hiddens = greedy_batched(shard, all_ids, 6)
    for row, ids in enumerate(all_ids):
        solo_tokens, solo_hiddens = greedy_solo(shard, ids, 6)
        assert batched_tokens[row] == solo_tokens
        assert all(torch.equal(b[row:row + 1], s) for b, s in zip(batched_hiddens, solo_hiddens))
