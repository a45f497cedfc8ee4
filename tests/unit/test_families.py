"""Model families (meshnet.models.families): each certified by split parity, unknown types refused.

Split parity: a tiny seeded model of the family, split at every layer boundary into an entry
shard ``[0, b)`` (embeddings, LM head) and a second shard ``[b, L)``, runs a prompt longer than
any sliding window as chunked prefill and then decodes token by token, one session alone and
two sessions batched; the float32 logits at every position equal the unsplit transformers
model's.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch.testing import assert_close

from meshnet.errors import ModelSourceError
from meshnet.layers import LayerRange
from meshnet.models.families import FAMILIES, FULL, SLIDING, family_of, layer_kinds

#: 13 prompt tokens (longer than the tiny sliding windows of 6), prefilled in chunks of 5, then 4 decoded
PROMPT = [5, 17, 300, 42, 7, 99, 123, 64, 8, 250, 31, 77, 410]
DECODED = [12, 501, 3, 88]
OTHER = [9, 400, 23, 11, 301, 6, 44, 45, 46]  # a second session's prompt, of another length
CHUNK = 5
#: where the shards and the whole model run (bench/device_check.sh sets cuda on a GPU machine)
DEVICE = os.environ.get("MESHNET_TEST_DEVICE", "cpu")
#: float32 on the CPU agrees to rounding; a GPU's kernels to the issue's tolerance (1e-4)
ATOL = 2e-5 if DEVICE == "cpu" else 1e-4


def Shard(*args, **kwargs):
    """A :class:`ShardModel` on the test device."""
    from meshnet.models.shard import ShardModel

    return ShardModel(*args, device=DEVICE, **kwargs)


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    """``family_model(name) -> (path, the unsplit transformers model)``, built once per family."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshnet.models.sources import byte_tokenizer

    built: dict = {}

    def get(name: str):
        if name not in built:
            cfg = dict(FAMILIES[name].tiny_config)
            config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).eval()
            path = tmp_path_factory.mktemp(f"family-{name}")
            model.save_pretrained(path)
            byte_tokenizer(config.vocab_size).save_pretrained(path)
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(DEVICE)
            built[name] = (path, reference)
        return built[name]

    return get


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device)).logits[0].float().cpu()


def split_logits(entry, rest, ids: list[int], decode_from: int) -> torch.Tensor:
    """Logits of ``ids`` through ``entry`` then ``rest``: chunked prefill up to ``decode_from``,
    then one token per step (each shard with its own cache, as two nodes hold them)."""
    from meshnet.models.caches import KVCache

    caches, out = (KVCache(), KVCache()), []
    steps = [(p, ids[p:min(p + CHUNK, decode_from)]) for p in range(0, decode_from, CHUNK)]
    steps += [(p, [ids[p]]) for p in range(decode_from, len(ids))]
    for position, chunk in steps:
        hidden = entry.forward(entry.embed_tokens(torch.tensor([chunk]), position), caches[0], position)
        if rest is not None:
            hidden = rest.forward(hidden, caches[1], position)
        out.append(entry.logits(hidden)[0])
    return torch.cat(out)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_split_of_the_family_gives_the_unsplit_models_logits(family_model, name):
    path, reference = family_model(name)
    ids = PROMPT + DECODED
    expected = reference_logits(reference, ids)
    layers = reference.config.num_hidden_layers
    for boundary in range(1, layers + 1):
        entry = Shard(path, LayerRange(0, boundary), dtype="float32")
        rest = Shard(path, LayerRange(boundary, layers), dtype="float32", load_head=False) \
            if boundary < layers else None
        got = split_logits(entry, rest, ids, len(PROMPT))
        assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"{name} split at {boundary}: {m}")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_batched_decode_step_of_sessions_of_different_lengths_gives_each_its_own_logits(family_model, name):
    from meshnet.models.caches import KVCache

    path, reference = family_model(name)
    layers = reference.config.num_hidden_layers
    entry = Shard(path, LayerRange(0, 2), dtype="float32")
    rest = Shard(path, LayerRange(2, layers), dtype="float32", load_head=False)
    prompts, nxt = [PROMPT, OTHER], [DECODED[0], DECODED[1]]
    caches = [(KVCache(), KVCache()) for _ in prompts]
    for (a, b), prompt in zip(caches, prompts):
        rest.forward(entry.forward(entry.embed_tokens(torch.tensor([prompt]), 0), a, 0), b, 0)
    positions = [len(p) for p in prompts]
    hidden = entry.forward_batch(entry.embed_tokens(torch.tensor([[t] for t in nxt]), positions),
                                 [a for a, _ in caches], positions)
    hidden = rest.forward_batch(hidden, [b for _, b in caches], positions)
    got = entry.logits(hidden)[:, -1]
    for row, (prompt, token) in enumerate(zip(prompts, nxt)):
        assert_close(got[row], reference_logits(reference, prompt + [token])[-1], atol=ATOL, rtol=0,
                     msg=lambda m: f"{name} row {row}: {m}")


@pytest.mark.parametrize("model_type", ["gemma3", "falcon_h1", "mamba", "mystery", None])
def test_a_model_type_no_family_serves_is_refused_naming_the_supported_ones(model_type):
    with pytest.raises(ModelSourceError, match=f"model type {model_type!r} is not supported") as info:
        family_of(types.SimpleNamespace(model_type=model_type))
    assert "gemma3_text, gpt2, gpt_oss, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_5_text, qwen3_moe, qwen3_next" in info.value.hint


def test_families_are_chosen_by_model_type():
    assert [family_of(types.SimpleNamespace(model_type=t)).name for t in ("llama", "gpt2", "qwen2")] == \
        ["llama", "gpt2", "qwen2"]


@pytest.mark.parametrize("config, kinds", [
    ({"num_hidden_layers": 3}, [FULL] * 3),
    ({"num_hidden_layers": 2, "sliding_window": 4096}, [SLIDING] * 2),
    ({"num_hidden_layers": 3, "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention",
                                                                    "full_attention"]}, [FULL, SLIDING, FULL]),
    ({"n_layer": 2}, [FULL] * 2),
])
def test_layer_kinds_follow_the_configs_layer_types(config, kinds):
    assert layer_kinds(types.SimpleNamespace(**config)) == kinds


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_family_is_certified_by_split_parity_at_every_two_and_three_shard_split(family_model, name):
    """Issue 25's certificate: a 300-token prompt in 128-token chunks (crossing the tiny sliding
    windows inside a chunk, across chunks and across shards), then 40 greedy tokens, every split
    into two shards and every split into three: the logits equal the whole model's (float32,
    max |diff| <= 1e-4) and the decided tokens equal generate's."""
    from itertools import combinations

    from meshnet.models.certify import certify

    path, reference = family_model(name)
    layers = int(reference.config.num_hidden_layers)
    splits = [(b,) for b in range(1, layers)] + list(combinations(range(1, layers), 2))
    results = certify(path, splits=splits, prompt_tokens=300, decode_tokens=40, chunk_tokens=128, device=DEVICE)
    print(f"{name}: {len(results)} splits, largest |diff| {max(r.max_abs_diff for r in results):.2e}, "
          f"tokens {sum(r.tokens_matched for r in results)}/{sum(r.tokens_decided for r in results)}")
    assert [r.boundaries for r in results] == splits
    assert all(r.passed for r in results), [r for r in results if not r.passed]
    assert all(r.tokens_decided >= 1 for r in results)  # tiny random models tie often: the logits are the proof


@pytest.mark.parametrize("name", sorted(FAMILIES))
async def test_a_replacement_hop_rebuilt_from_the_replayed_input_gives_the_same_logits(family_model, name):
    """Failover per family: the second shard fails after 6 decode steps; a fresh shard (another
    node's) is sent the input history it missed as prefill chunks (:func:`rechunk`, frames in
    float32 through the node's wire codec), rebuilds the session's KV cache, and the decode goes
    on with the whole model's logits."""
    from meshnet.dataplane.replay import rechunk
    from meshnet.models.caches import KVCache
    from meshnet.node.entry import WireCodec

    path, reference = family_model(name)
    layers = int(reference.config.num_hidden_layers)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (40,), generator=generator).tolist()
    want = reference_logits(reference, ids)
    codec, prefill = WireCodec("float32"), 24
    entry, rest = Shard(path, LayerRange(0, 2)), Shard(path, LayerRange(2, layers))
    caches, history, out = [KVCache(), KVCache()], [], []
    steps = [(p, ids[p:min(p + CHUNK, prefill)]) for p in range(0, prefill, CHUNK)]
    steps += [(p, [ids[p]]) for p in range(prefill, len(ids))]
    for position, chunk in steps:
        hidden = entry.forward(entry.embed_tokens(torch.tensor([chunk]), position), caches[0], position)
        frame = await codec.encode(hidden)
        if position == prefill + 6:  # the hop failed: its replacement replays what it missed
            rest, caches[1] = Shard(path, LayerRange(2, layers)), KVCache()
            async for at, replayed, _tokens in rechunk(history, codec, CHUNK):
                rest.forward(await codec.decode(replayed), caches[1], at)
        history.append((position, frame, len(chunk)))
        out.append(entry.logits(rest.forward(await codec.decode(frame), caches[1], position))[0])
    assert_close(torch.cat(out), want, atol=ATOL, rtol=0)


def test_gpt_oss_experts_stored_as_mxfp4_load_as_their_dequantized_values(family_model, tmp_path):
    """gpt-oss's released checkpoints store the experts as MXFP4 (``*_blocks`` and ``*_scales``);
    a shard dequantizes them at load. Random 4-bit codes and exponents are written as such a
    checkpoint; the whole model given their dequantized values is the reference."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors


    path, reference = family_model("gpt_oss")
    config = reference.config
    generator = torch.Generator().manual_seed(3)
    state, packed = {k: v.clone() for k, v in reference.state_dict().items()}, {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, cols = state[key].shape  # stored transposed: the codes run along the rows
        blocks = torch.randint(0, 256, (experts, cols, rows // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(120, 127, (experts, cols, rows // 32), dtype=torch.uint8, generator=generator)
        state[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        packed.update({f"{key}_blocks": blocks, f"{key}_scales": scales})
    mxfp4 = tmp_path / "mxfp4"
    shutil.copytree(path, mxfp4)
    for file in mxfp4.glob("*.safetensors"):
        file.unlink()
    (mxfp4 / "model.safetensors.index.json").unlink(missing_ok=True)
    stored = {k: v.contiguous() for k, v in state.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    save_file({**stored, **packed}, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    dense = AutoModelForCausalLM.from_config(config).eval()
    dense.load_state_dict(state)
    dense.to(DEVICE)
    ids = PROMPT + DECODED
    layers = config.num_hidden_layers
    entry = Shard(mxfp4, LayerRange(0, 2), dtype="float32")
    rest = Shard(mxfp4, LayerRange(2, layers), dtype="float32", load_head=False)
    assert_close(split_logits(entry, rest, ids, len(PROMPT)), reference_logits(dense, ids), atol=ATOL, rtol=0)
    assert not torch.equal(state["model.layers.0.mlp.experts.down_proj"],
                           reference.state_dict()["model.layers.0.mlp.experts.down_proj"])


#: tiny multimodal wrappers: (wrapper type, its text family, extra wrapper config)
WRAPPERS = {
    "gemma3": ("gemma3", {"mm_tokens_per_image": 4,
                          "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                            "num_attention_heads": 2, "image_size": 56, "patch_size": 14}}),
    "qwen3_5": ("qwen3_5", {"vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                                              "out_hidden_size": 64}}),
}


@pytest.mark.parametrize("wrapper, layout", [("gemma3", "language_model.model."), ("gemma3", "model.language_model."),
                                             ("qwen3_5", "model.language_model.")])
def test_the_language_model_of_a_multimodal_wrapper_is_served_as_its_text_family(tmp_path, wrapper, layout):
    """Gemma 3's and Qwen3.5's released checkpoints are image-text wrappers (``gemma3``,
    ``qwen3_5``: a ``text_config``, the language model's tensors under a prefix, older releases'
    or transformers 5's); a shard serves the language model, split, with the whole wrapper's
    logits on text, and never reads the vision tower."""
    import re

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    from meshnet.models.families import family_of, load_config
    from meshnet.models.sources import byte_tokenizer

    family, extra = WRAPPERS[wrapper]
    text = dict(FAMILIES[family].tiny_config)
    text_type = text.pop("model_type")
    text["final_logit_softcapping"] = None  # as Gemma 3's released text configs; the wrapper's head never caps
    config = AutoConfig.for_model(wrapper, text_config=text, **extra)
    torch.manual_seed(0)
    whole = AutoModelForImageTextToText.from_config(config).eval()
    whole.save_pretrained(tmp_path)
    whole.to(DEVICE)
    byte_tokenizer(config.text_config.vocab_size).save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    save_file({re.sub(r"^(language_model\.model\.|model\.language_model\.)", layout, k): v.contiguous()
               for k, v in stored.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert any(k.startswith(f"{layout}layers.") for k in load_file(tmp_path / "model.safetensors"))
    assert load_config(tmp_path).model_type == text_type and family_of(load_config(tmp_path)).name == family
    ids = PROMPT + DECODED
    entry = Shard(tmp_path, LayerRange(0, 1), dtype="float32")
    rest = Shard(tmp_path, LayerRange(1, 4), dtype="float32", load_head=False)
    assert_close(split_logits(entry, rest, ids, len(PROMPT)), reference_logits(whole, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["gemma3", "mistral", "gpt_oss"])
def test_a_sliding_window_layer_keeps_only_its_window_and_the_logits_stay_exact(family_model, name):
    """A sliding layer's cache holds at most window + the rewind margin + block + one chunk
    positions however long the context (here 100 tokens through a window of 6, blocks of 4), a full
    layer every position; the logits equal the whole model's."""
    from meshnet.models.caches import MAX_REWIND, KVCache

    path, reference = family_model(name)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 512, (100,), generator=generator).tolist()
    shard = Shard(path, LayerRange(0, reference.config.num_hidden_layers), dtype="float32")
    cache, out = KVCache(block_tokens=4), []
    steps = [(p, ids[p:p + CHUNK]) for p in range(0, 30, CHUNK)] + [(p, [ids[p]]) for p in range(30, 100)]
    for position, chunk in steps:
        out.append(shard.logits(shard.forward(shard.embed_tokens(torch.tensor([chunk]), position), cache, position))[0])
    assert_close(torch.cat(out), reference_logits(reference, ids), atol=ATOL, rtol=0)
    sliding = set(shard._windows)
    assert sliding and all(cache.keys[i].shape[-2] <= 6 + MAX_REWIND + 4 + CHUNK for i in sliding)
    assert all(cache.lengths[i] == 100 for i in cache.keys if i not in sliding)
    assert len(sliding) == {"gemma3": 3, "mistral": 4, "gpt_oss": 2}[name]


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3", "gpt_oss", "qwen2"])
def test_speculative_steps_rewound_past_their_rejected_drafts_give_the_whole_models_logits(family_model, name):
    """Steps of 1 + 4 positions where only some drafts are right (the rest are wrong tokens, as
    rejected drafts are), each next step rewinding the cache past them (ADR-0058), give at every
    kept position the whole model's logits, sliding-window layers included (window 6, blocks of 4:
    their buffers are trimmed and regrown many times over 90 tokens)."""
    from meshnet.models.caches import KVCache

    path, reference = family_model(name)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 512, (90,), generator=generator).tolist()
    shard = Shard(path, LayerRange(0, reference.config.num_hidden_layers), dtype="float32")
    cache, out = KVCache(block_tokens=4), []
    for position in range(0, 16, CHUNK):
        chunk = ids[position:min(position + CHUNK, 16)]
        out.append(shard.logits(shard.forward(shard.embed_tokens(torch.tensor([chunk]), position), cache, position))[0])
    position, held, kept_counts = 16, 16, [0, 4, 2, 1, 3, 0, 4]
    step = 0
    while position < 90:
        kept = min(kept_counts[step % len(kept_counts)], 90 - position - 1)
        fed = ids[position:position + 1 + kept] + [(t + 7) % 500 + 3 for t in ids[position + 1 + kept:position + 5]]
        fed = fed + [11] * (5 - len(fed))
        cache.rewind(held - position)
        logits = shard.logits(shard.forward(shard.embed_tokens(torch.tensor([fed]), position), cache, position))[0]
        out.append(logits[:1 + kept])
        held, position, step = position + len(fed), position + 1 + kept, step + 1
    assert_close(torch.cat(out), reference_logits(reference, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3", "gpt_oss", "qwen2"])
def test_a_packed_batch_of_decode_and_speculative_steps_equals_each_step_alone(family_model, name):
    """Three sessions' steps of 1, 4 and 3 positions as one packed row (ADR-0058) give each
    session's hidden states as its step alone does, and leave each cache as the step alone does."""
    from meshnet.models.caches import KVCache

    path, reference = family_model(name)
    shard = Shard(path, LayerRange(0, reference.config.num_hidden_layers), dtype="float32")
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (12, 20, 9)]
    steps = [torch.randint(3, 512, (q,), generator=generator).tolist() for q in (1, 4, 3)]

    def prefilled() -> list:
        caches = [KVCache(block_tokens=4) for _ in prompts]
        for cache, ids in zip(caches, prompts):
            shard.forward(shard.embed_tokens(torch.tensor([ids]), 0), cache, 0)
        return caches

    alone, packed_caches = prefilled(), prefilled()
    want = [shard.forward(shard.embed_tokens(torch.tensor([s]), len(p)), c, len(p))
            for s, p, c in zip(steps, prompts, alone)]
    hidden = torch.cat([shard.embed_tokens(torch.tensor([s]), len(p)) for s, p in zip(steps, prompts)], dim=1)
    got = shard.forward_packed(hidden, packed_caches, [len(p) for p in prompts], [len(s) for s in steps])
    assert got.shape == (1, 8, reference.config.hidden_size)
    for w, g in zip(want, got.split([1, 4, 3], dim=1)):
        assert_close(g, w, atol=ATOL, rtol=0)
    assert [c.lengths for c in packed_caches] == [c.lengths for c in alone]
