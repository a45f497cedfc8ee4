"""Structured outputs (ADR-0053): ``response_format`` json_object / json_schema decode under a
grammar at the entry, so even a tiny random model's answer parses and fits the schema; streamed
and with ``n`` too. tiny-llama, the whole model on one in-process node."""

from __future__ import annotations

import json

import pytest

from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings

MODEL = "tiny-llama"
URL = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer",
                                                                                          "minimum": 0,
                                                                                          "maximum": 9}},
          "required": ["answer", "confidence"], "additionalProperties": False}


@pytest.fixture(scope="module")
def runtime(tiny_model_path) -> NodeRuntime:
    rt = NodeRuntime(max_loaded_shards=1, compute_dtype="float32")
    rt.load(MODEL, tiny_model_path(MODEL), LayerRange(0, 4))
    return rt


@pytest.fixture
async def entry(asgi_client, runtime):
    return await asgi_client(build_app(NodeSettings(node_id="entry", port=8811, wire_dtype="float32"),
                                       runtime=runtime), "http://entry")


def fits(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"answer", "confidence"} and value["answer"] in ("yes", "no")
    assert isinstance(value["confidence"], int) and 0 <= value["confidence"] <= 9
    return value


@pytest.mark.parametrize("temperature", [0, 1.0])
async def test_a_json_schema_answer_always_parses_and_fits(entry, temperature):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": temperature, "seed": 3, "n": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA,
                                                                       "strict": True}}}
    resp = await entry.post(URL, json=body)
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        fits(choice["message"]["content"])
        assert choice["finish_reason"] == "stop"  # the grammar ended it, not max_tokens


async def test_json_object_streamed_is_one_json_object(entry):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 120, "temperature": 0, "stream": True,
            "response_format": {"type": "json_object"}}
    resp = await entry.post(URL, json=body)
    events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: a prefix of an object (OpenAI's behaviour too)
        assert finish == ["length"] and text.lstrip().startswith("{")


async def test_free_text_is_unchanged_by_the_grammar_machinery(entry):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0}
    plain = (await entry.post(URL, json=body)).json()["meshnet"]["completion_token_ids"]
    text = (await entry.post(URL, json={**body, "response_format": {"type": "text"}})).json()
    assert text["meshnet"]["completion_token_ids"] == plain
