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
    messages, _ = prompt_messages(req)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call functions")
    assert '"name": "get_weather"' in messages[0]["content"] and '"name": "get_time"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert messages[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    assert "You may call" not in prompt_messages(request(tool_choice="none"))[0][0]["content"]


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


# Chat templates in the three tool syntaxes, written for these tests (each renders the tools,
# an assistant's earlier calls and the tools' results the way its family does).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nEnvironment: ipython\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}"
    "<|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n<|python_tag|>{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}"
    "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% elif m.role == 'tool' %}[TOOL_RESULTS]"
    "{\"call_id\": \"{{ m.tool_call_id }}\", \"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}{% if c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, \"id\": "
    "\"{{ c.id }}\"}{% endfor %}]</s>{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")


def tokenizer_with(template: str | None):
    from meshnet.models.sources import byte_tokenizer
    tok = byte_tokenizer(512)
    if template is not None:
        tok.chat_template = template
    return tok


def conversation(call_id: str) -> dict:
    """A second turn: the assistant called get_weather, the tool answered, the user asks again."""
    return {"tools": [WEATHER, TIME], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 C and sunny"},
        {"role": "user", "content": "And in Oslo?"}]}


@pytest.mark.parametrize("template, name, rendered", [
    (HERMES_TEMPLATE, "hermes", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                                 "<tool_response>\n18 C and sunny\n</tool_response>", '"name": "get_time"']),
    (LLAMA3_TEMPLATE, "llama3", ['<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                                 "<|im_start|>ipython\n18 C and sunny", "Environment: ipython"]),
    (MISTRAL_TEMPLATE, "mistral", ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
                                   '"id": "abcDEF123"}]', '[TOOL_RESULTS]{"call_id": "abcDEF123", "content": '
                                   '"18 C and sunny"}[/TOOL_RESULTS]', "[AVAILABLE_TOOLS]"]),
])
def test_a_template_that_knows_tools_renders_them_earlier_calls_and_results_in_its_own_syntax(template, name,
                                                                                                rendered):
    from meshnet.gateway.tools import tool_syntax
    from meshnet.node.entry import chat_token_ids
    tok = tokenizer_with(template)
    syntax = tool_syntax(tok)
    assert (syntax.name, syntax.native) == (name, True)
    req = parse_chat_request(json.dumps(conversation("abcDEF123")).encode())
    messages, tools = prompt_messages(req, syntax)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    text = tok.decode(chat_token_ids(tok, messages, tools))
    for piece in rendered:
        assert piece in text
    assert "You may call functions" not in text  # the template's own rendering, not meshnet's prompt


def test_every_tiny_family_template_knows_no_tools_so_the_documented_prompt_is_used(tiny_model_path):
    from transformers import AutoTokenizer

    from meshnet.gateway.tools import PROMPT, tool_syntax
    for preset in ("tiny-llama", "tiny-gpt2"):  # the other tiny families are built with the same tokenizer
        tok = AutoTokenizer.from_pretrained(tiny_model_path(preset))
        assert tool_syntax(tok) is PROMPT, preset
        messages, tools = prompt_messages(request(), PROMPT)
        assert tools is None and messages[0]["content"].startswith("You may call functions")
    assert tool_syntax(tokenizer_with(None)) is PROMPT


@pytest.mark.parametrize("template, answer, content, calls", [
    (HERMES_TEMPLATE, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                      '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (LLAMA3_TEMPLATE, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                      '{"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (LLAMA3_TEMPLATE, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    (LLAMA3_TEMPLATE, 'It is {"name": "x"} warm.', 'It is {"name": "x"} warm.', []),  # text stays text
    (MISTRAL_TEMPLATE, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                       '{"name": "get_time", "arguments": {}}]', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (MISTRAL_TEMPLATE, 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
     "Checking.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (MISTRAL_TEMPLATE, "[TOOL_CALLS]unknown_tool[ARGS]{}", "[TOOL_CALLS]unknown_tool[ARGS]{}", []),
])
def test_each_family_s_answers_are_parsed_into_openai_tool_calls(template, answer, content, calls):
    from meshnet.gateway.tools import tool_syntax
    syntax = tool_syntax(tokenizer_with(template))
    got_content, got_calls = parse_answer(answer, request(), syntax)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    if syntax.name == "mistral":  # its template accepts only 9-character ids when they come back
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)


def test_the_legacy_functions_are_tools_and_their_conversation_renders_as_calls_and_answers():
    from meshnet.protocol.structured import legacy_call_id
    fn = WEATHER["function"]
    req = parse_chat_request(json.dumps({"functions": [fn], "function_call": {"name": "get_weather"}, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "18 C"},
        {"role": "user", "content": "And Oslo?"}]}).encode())
    assert req.legacy_functions and [t.function.name for t in req.tools] == ["get_weather"]
    assert [t.function.name for t in req.forced_tools()] == ["get_weather"] and req.parallel_tool_calls is False
    call_id = legacy_call_id("get_weather")
    assert len(call_id) == 9 and call_id.isalnum()
    assert req.messages[1].tool_calls[0].id == call_id and req.messages[2].tool_call_id == call_id
    messages, _ = prompt_messages(req)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    auto = parse_chat_request(json.dumps({"functions": [fn], "function_call": "auto", "messages": ASK}).encode())
    assert auto.tool_choice == "auto" and auto.legacy_functions


@pytest.mark.parametrize("fields, param", [
    ({"function_call": "auto"}, "function_call"),
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
    ({"functions": [WEATHER["function"]], "messages": [{"role": "function", "content": "x"}]}, "messages.0"),
    ({"functions": [WEATHER["function"]], "messages": [
        {"role": "user", "content": "x", "function_call": {"name": "get_weather", "arguments": "{}"}}]}, "messages.0"),
])
def test_bad_legacy_function_fields_are_400_naming_them(fields, param):
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(json.dumps({"messages": ASK, **fields}).encode())
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, None])
def test_a_call_as_the_family_s_own_template_renders_it_parses_back_to_the_same_call(template):
    """What a model of the family learned to write is what its template writes for an earlier
    call: the assistant turn the template renders (after the generation prompt of the turn
    before) parses back into that call."""
    from meshnet.gateway.tools import tool_syntax
    from meshnet.node.entry import chat_token_ids
    tok = tokenizer_with(template)
    syntax = tool_syntax(tok)
    req = parse_chat_request(json.dumps(conversation("abcDEF123")).encode())
    messages, tools = prompt_messages(req, syntax)
    k = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    before = tok.decode(chat_token_ids(tok, messages[:k], tools))  # up to the assistant's turn
    whole = tok.decode(chat_token_ids(tok, messages[:k + 1], tools))
    turn = whole[len(before):] if whole.startswith(before) else whole[whole.rindex("[/INST]") + 7:]
    turn = turn.split("<|im_end|>")[0].split("</s>")[0]
    content, calls = parse_answer(turn, request(), syntax)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})], (syntax.name, turn)
