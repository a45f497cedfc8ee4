"""Structured outputs (ADR-0053): ``response_format`` json_object / json_schema decode under a
grammar at the entry, so even a tiny random model's answer parses and fits the schema; streamed
and with ``n`` too. tiny-llama, the whole model on one in-process node."""

from __future__ import annotations

import json

import pytest


MODEL = "tiny-llama"
URL = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer",
                                                                                          "minimum": 0,
                                                                                          "maximum": 9}},
          "required": ["answer", "confidence"], "additionalProperties": False}


@pytest.fixture
def entry(whole_tiny_entry):
    return whole_tiny_entry


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


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_tool_call_is_a_valid_call_even_from_a_tiny_random_model(entry, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60,
            "temperature": 0, "tools": [WEATHER], "tool_choice": "required", "stream": stream}
    resp = await entry.post(URL, json=body)
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = [json.loads(e.removeprefix("data: ")) for e in resp.text.split("\n\n") if e and e != "data: [DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert len(calls) == 1 and calls[0][0]["index"] == 0
        call, finish = calls[0][0], chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = resp.json()["choices"][0]
        assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
        call, finish = choice["message"]["tool_calls"][0], choice["finish_reason"]
    assert finish == "tool_calls" and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_legacy_functions_answer_in_the_legacy_shape(entry, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60,
            "temperature": 0, "functions": [WEATHER["function"]], "function_call": {"name": "get_weather"},
            "stream": stream}
    resp = await entry.post(URL, json=body)
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = [json.loads(e.removeprefix("data: ")) for e in resp.text.split("\n\n") if e and e != "data: [DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert not [d for d in deltas if "tool_calls" in d]
        [call] = [d["function_call"] for d in deltas if "function_call" in d]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        message = resp.json()["choices"][0]["message"]
        assert message["content"] is None and "tool_calls" not in message
        call, finish = message["function_call"], resp.json()["choices"][0]["finish_reason"]
    assert finish == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Oslo")


async def test_a_conversation_with_an_earlier_call_and_its_answer_is_accepted(entry, tiny_model_path):
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]}
    resp = await entry.post(URL, json=body)
    assert resp.status_code == 200, resp.text
    from transformers import AutoTokenizer

    from meshnet.gateway.tools import prompt_messages
    from meshnet.node.entry import chat_token_ids
    from meshnet.protocol.openai import parse_chat_request

    rendered, tools = prompt_messages(parse_chat_request(json.dumps(body).encode()))
    assert tools is None  # the tiny models' ChatML template knows no tools: the documented prompt
    assert "<tool_response>\n18 C\n</tool_response>" in rendered[-1]["content"]  # the call and its answer rendered
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(MODEL))
    assert resp.json()["usage"]["prompt_tokens"] == len(chat_token_ids(tokenizer, rendered))
