"""Speculative decoding end to end on SmolLM2 (ADR-0058): a tracker and three node processes,
float32 compute and wire, the default ``--speculate auto``. Greedy answers equal transformers'
``generate`` on the unsplit model token for token, on answers that copy their prompt (drafts kept)
and on free text, with stop strings, ``max_tokens`` cut inside a kept run, ``n`` and logprobs; a
difference is allowed only from a near-tie on (:data:`NEAR_TIE`), which float32 rounding of a
several-position step may decide either way."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.integration.conftest import REAL
from tests.integration.mesh import three_hops

pytestmark = pytest.mark.slow

CODE = ["def add(a, b):\n    return a + b\n",
        "def area(width, height):\n    result = width * height\n    return result\n",
        "def greet(name):\n    message = 'Hello, ' + name\n    print(message)\n    return message\n",
        "def total(items):\n    s = 0\n    for item in items:\n        s = s + item\n    return s\n",
        "def is_even(number):\n    return number % 2 == 0\n"]
EDITS = ([f"Add type hints to this Python function and repeat it:\n\n{c}" for c in CODE]
         + [f"Rewrite this function with a docstring:\n\n{c}" for c in CODE])
FREE = ["What is the capital of France?", "Write a story about a cat.", "Name three colours.",
        "How do bees make honey?", "What is 12 times 12?", "Give me a tip for sleeping well.",
        "What is Python?", "Describe the sea in one sentence.", "Why is the sky blue?", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def mesh(real_model_path, tmp_path_factory):
    with three_hops(tmp_path_factory.mktemp("mesh"), REAL) as m:
        yield m


@pytest.fixture(scope="module")
def reference(real_model_path):
    """``reference(prompt text, max_tokens) -> token ids``: greedy ``generate`` of the unsplit model."""
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    tok = AutoTokenizer.from_pretrained(real_model_path)
    model = whole_model(real_model_path)

    def margins(text: str, max_tokens: int) -> tuple[list[int], list[float]]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        gaps = [float(top[0] - top[1]) for top in (torch.topk(s[0].float(), 2).values for s in out.scores)]
        kept = [i for i, t in enumerate(tokens) if t not in (tok.eos_token_id, 2)]  # <|im_end|> (2) ends a turn
        return [tokens[i] for i in kept], [gaps[i] for i in kept]

    def run(text: str, max_tokens: int) -> list[int]:
        return margins(text, max_tokens)[0]

    run.tokenizer, run.margins = tok, margins
    return run


#: a speculative step's float32 logits differ from single steps' by rounding (up to 6e-5 measured on
#: SmolLM2: a 5-row product is not summed in a 1-row product's order); below this top-two gap of the
#: reference a greedy choice is a near-tie that rounding may decide either way
NEAR_TIE = 1e-3


def assert_same_until_a_near_tie(got: list[int], want: list[int], gaps: list[float], text: str) -> bool:
    """``got`` equals ``want``, or first differs where the reference's top two logits were within
    :data:`NEAR_TIE` (after which the texts diverge). Returns whether they are wholly equal."""
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if first is None:
        assert len(got) == len(want), text
        return True
    assert gaps[first] < NEAR_TIE, f"{text!r}: token {first} differs with a top-two gap of {gaps[first]:.2e}"
    return False


def chat(mesh, text: str, **kw) -> dict:
    body = {"model": REAL, "messages": [{"role": "user", "content": text}], "temperature": 0, **kw}
    resp = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_twenty_greedy_answers_with_speculation_equal_plain_generate(mesh, reference):
    kept, equal = [], 0
    for text in EDITS + FREE:
        max_tokens = 64 if text in EDITS else 24
        data = chat(mesh, text, max_tokens=max_tokens)
        want, gaps = reference.margins(text, max_tokens)
        equal += assert_same_until_a_near_tie(data["meshnet"]["completion_token_ids"], want, gaps, text)
        kept.append(data["meshnet"]["speculation"]["accepted"])
    print(f"drafts kept per answer: {kept}; answers wholly equal: {equal} of {len(kept)}")
    assert equal >= len(kept) - 1
    assert sum(kept[:len(EDITS)]) > 3 * len(EDITS)  # answers that copy their prompt keep drafts (75 here)


def test_stop_strings_max_tokens_n_and_logprobs_behave_as_without_speculation(mesh, reference):
    text = EDITS[1]
    want = reference(text, 64)
    tok = reference.tokenizer
    for max_tokens in (1, 5, 17):  # cut inside runs of kept drafts
        data = chat(mesh, text, max_tokens=max_tokens)
        assert data["meshnet"]["completion_token_ids"] == want[:max_tokens]
    full = tok.decode(want)
    stop = tok.decode(want[20:22]).strip() or "def"  # a string the answer holds, past a run of kept drafts
    data = chat(mesh, text, max_tokens=64, stop=[stop])
    assert data["choices"][0]["message"]["content"] == full[:full.index(stop)]
    assert data["choices"][0]["finish_reason"] == "stop"
    data = chat(mesh, text, max_tokens=20, n=2, logprobs=True, top_logprobs=2)
    for choice, meta in zip(data["choices"], data["meshnet"]["choices"]):
        assert meta["completion_token_ids"] == want[:20]
        assert [e["token"] for e in choice["logprobs"]["content"]] == [tok.decode([t]) for t in want[:20]]
