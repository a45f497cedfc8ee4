"""Incremental detokenization and token bytes (meshnet.gateway.detokenize) on the tiny byte-level
tokenizer: the incremental text equals decoding everything at once."""

from __future__ import annotations

import random

import pytest

from meshnet.gateway.openai_api import TextDecoder, max_token_chars, token_bytes


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path("tiny-llama"))


def test_incremental_text_equals_a_full_decode(tokenizer):
    text = "Grüße, 世界 🙂 — tabs\tand\nnewlines"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = TextDecoder(tokenizer)
    seen = [decoder.add(i) for i in ids]
    assert decoder.flush() == text
    assert all("\ufffd" not in s for s in seen)  # a split character is held back, never half-emitted
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # text only grows
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        decoder = TextDecoder(tokenizer)
        for i in ids:
            decoder.add(i)
        assert decoder.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def test_token_bytes_are_exact_for_partial_characters(tokenizer):
    ids = tokenizer.encode("é🙂", add_special_tokens=False)
    assert sum((token_bytes(tokenizer, i) for i in ids), []) == list("é🙂".encode())
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(tokenizer, end) == list(b"<|im_end|>")


def test_max_token_chars_bounds_the_token_count(tokenizer):
    longest = max_token_chars(tokenizer)
    text = "hello world, " * 50
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= len(text) / longest
