"""Tool calls (meshnet.gateway.tools and the request's tool fields): the tools' prompt, earlier
calls rendered back, answers parsed into OpenAI ``tool_calls``."""

from __future__ import annotations

import json

import pytest

from meshnet.errors import InvalidRequest
from meshnet.gateway.tools import parse_answer, prompt_messages
from meshnet.protocol.openai import parse_chat_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def request(**fields):
    return parse_chat_request(json.dumps({"messages": ASK, "tools": [WEATHER, TIME], **fields}).encode())


def test_the_tools_are_listed_in_a_system_message_and_earlier_calls_render_back():
    req = request(messages=[
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    messages = prompt_messages(req)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call functions")
    assert '"name": "get_weather"' in messages[0]["content"] and '"name": "get_time"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert messages[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    assert "You may call" not in prompt_messages(request(tool_choice="none"))[0]["content"]


def test_an_auto_answer_s_tool_call_blocks_become_calls_and_the_rest_content():
    req = request()
    text = ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "nope", '
            '"arguments": {}}</tool_call>')
    content, calls = parse_answer(text, req)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert content == 'Let me check.\n\n\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>'.strip()
    assert len(parse_answer(text, request(parallel_tool_calls=False))[1]) == 1
    assert parse_answer("Just text.", req) == ("Just text.", [])


def test_a_forced_call_is_the_whole_answer_and_its_schema_is_the_sampling_grammar():
    req = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    schema = json.loads(req.sampling().json_schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == {**WEATHER["function"]["parameters"], "additionalProperties": False}
    content, calls = parse_answer('{"name": "get_weather", "arguments": {"city": "Oslo"}}', req)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert "anyOf" in json.loads(request(tool_choice="required").sampling().json_schema)
    assert parse_answer('{"name": "get_wea', req) == ('{"name": "get_wea', [])  # cut by max_tokens


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_fields_are_400_naming_them(fields, param):
    with pytest.raises(InvalidRequest) as info:
        request(**fields)
    assert info.value.status == 400 and info.value.param == param
