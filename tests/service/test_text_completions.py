"""``POST /v1/completions`` (meshnet.gateway.completions) at an entry node in-process (tiny-llama,
the whole model on one node) and through a tracker that serves layers itself."""

from __future__ import annotations

import json

import pytest
import torch


MODEL = "tiny-llama"
URL = "/v1/completions"


@pytest.fixture
def entry(whole_tiny_entry):
    return whole_tiny_entry


def generate(tiny_model_path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(MODEL), dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


async def test_token_id_prompts_give_generates_greedy_tokens_and_openai_shapes(entry, tiny_model_path):
    ids = [[40, 41, 42, 43, 44], [100, 7, 8]]
    resp = await entry.post(URL, json={"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0, "n": 2})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    tokens = body["meshnet"]["choices"]
    for p, prompt in enumerate(ids):
        want = generate(tiny_model_path, prompt, 6)
        want = want[:want.index(2)] if 2 in want else want  # the end token ends a choice, unsent
        assert tokens[2 * p]["completion_token_ids"] == tokens[2 * p + 1]["completion_token_ids"] == want
    assert body["usage"]["prompt_tokens"] == 8
    assert body["usage"]["completion_tokens"] == sum(len(t["completion_token_ids"]) for t in tokens)


async def test_echo_logprobs_and_scoring_with_no_new_tokens(entry):
    scored = (await entry.post(URL, json={"model": MODEL, "prompt": "abc", "max_tokens": 0, "echo": True})).json()
    assert [(c["text"], c["finish_reason"]) for c in scored["choices"]] == [("abc", "length")]
    assert scored["usage"]["completion_tokens"] == 0
    body = (await entry.post(URL, json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0,
                                        "echo": True})).json()
    assert body["choices"][0]["text"].startswith("abc")
    lp = (await entry.post(URL, json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0,
                                      "logprobs": 2})).json()["choices"][0]["logprobs"]
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 0
    assert all(len(top) <= 2 and v <= 0 for top, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0


async def test_a_stream_gives_the_same_text_and_one_usage(entry):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    plain = (await entry.post(URL, json=body)).json()
    resp = await entry.post(URL, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("fields, code, param", [
    ({"prompt": "x", "suffix": "y"}, "unsupported_parameter", "suffix"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "unsupported_parameter", "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "invalid_field", "max_tokens"),
    ({"prompt": "x", "best_of": 3}, "invalid_field", "best_of"),
    ({"prompt": []}, "invalid_field", "prompt"),
    ({"prompt": [1, 2, 99999]}, "invalid_field", "prompt"),
    ({"prompt": "x", "logprobs": 6}, "invalid_field", "logprobs"),
    ({"prompt": "x", "max_tokens": True}, "invalid_field", "max_tokens"),
])
async def test_bad_requests_are_400_naming_the_field(entry, fields, code, param):
    resp = await entry.post(URL, json={"model": MODEL, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
