"""bench/pipeline.py measures the prompt lengths it names (chat template applied, in tokens)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "pipeline.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n_tokens", [64, 512, 1024])
def test_prompt_of_gives_prompts_of_the_asked_length(bench, tiny_model_path, n_tokens):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path("tiny-llama"))
    ids = bench.chat_ids(tok, bench.prompt_of(tok, n_tokens))
    assert all(isinstance(i, int) for i in ids)
    # word-granular trimming: within one word (at most 8 byte-level tokens) of the target, never over
    assert n_tokens - 8 <= len(ids) <= n_tokens
