"""The chat request schema (meshnet.protocol.openai): every accepted parameter in range, every
other one a 400 naming it, never silently dropped."""

from __future__ import annotations

import json

import pytest

from meshnet.errors import InvalidRequest
from meshnet.protocol.openai import SEED_MAX, SamplingParams, parse_chat_request

HI = [{"role": "user", "content": "hi"}]


def parse(**fields):
    return parse_chat_request(json.dumps({"messages": HI, **fields}).encode())


def refusal(**fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(**fields)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("fields, param", [
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 10**30}, "max_tokens"),
])
def test_out_of_range_values_are_400_naming_the_field(fields, param):
    err = refusal(**fields)
    assert err.code == "invalid_field" and err.param == param
    assert f"'{param}'" in err.message


def test_the_seed_error_states_the_accepted_range():
    assert f"[0, {SEED_MAX}]" in refusal(seed=2**64).message
    assert SEED_MAX == 2**63 - 1
    assert parse(seed=SEED_MAX).seed == SEED_MAX


@pytest.mark.parametrize("fields, param", [
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"metadata": {"k": "v"}}, "metadata"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"store": True}, "store"),
    ({"temprature": 0.5}, "temprature"),
    ({"messages": [{"role": "user", "content": "hi", "tool_chain": []}]}, "messages.0.tool_chain"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
])
def test_unsupported_and_unknown_parameters_are_400_naming_them(fields, param):
    err = refusal(**fields)
    assert err.code == "unsupported_parameter" and err.param == param
    assert f"'{param}'" in err.message


def test_null_means_not_sent_and_harmless_fields_are_accepted():
    req = parse(tools=None, tool_choice=None, user="end-user-7", store=False,
                response_format={"type": "text"}, seed=None)
    assert req.user == "end-user-7"


def test_sampling_carries_every_honoured_parameter():
    req = parse(temperature=0.7, top_p=0.9, seed=3, stop="END", max_completion_tokens=9,
                frequency_penalty=0.5, presence_penalty=-0.5, logit_bias={"12": -100, "3": 2.5},
                logprobs=True, top_logprobs=4, n=2)
    assert req.n == 2
    assert req.sampling() == SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=3, stop=("END",),
                                            frequency_penalty=0.5, presence_penalty=-0.5,
                                            logit_bias=((3, 2.5), (12, -100.0)), top_logprobs=4)
    assert parse(logprobs=True).sampling().top_logprobs == 0
    assert parse().sampling().top_logprobs is None


@pytest.mark.parametrize("content, where", [
    ('"hi \\ud800 there"', 3),                                               # a lone high surrogate
    ('"\\udfff"', 0),                                                        # a lone low surrogate
    ('[{"type": "text", "text": "ok "}, {"type": "text", "text": "\\ud83d"}]', 3),  # in a text part
])
def test_a_lone_surrogate_in_a_message_is_400_naming_the_content_not_a_tokenizer_500(content, where):
    body = f'{{"model": "m", "messages": [{{"role": "user", "content": {content}}}]}}'.encode()
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(body)
    assert info.value.status == 400 and info.value.param == "messages.0.content"
    assert "lone surrogate" in info.value.message and f"at character {where}" in info.value.message


def test_a_surrogate_pair_is_one_real_character_and_accepted():
    body = '{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'.encode()
    assert parse_chat_request(body).messages[0].content == "\U0001F600"


def test_message_fields_openai_accepts_are_taken_and_nulls_count_as_not_sent():
    req = parse(messages=[{"role": "system", "content": "Be brief.", "name": None},
                          {"role": "user", "content": "hi", "name": "bob"},
                          {"role": "assistant", "content": "no", "refusal": None}])
    assert [m.model_dump(exclude_none=True) for m in req.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "no"}]


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("n", True), ("max_tokens", 2.5), ("seed", "7"),
                                          ("stream", "yes"), ("logprobs", 1), ("top_logprobs", False)])
def test_a_value_of_the_wrong_json_type_is_400_not_coerced(field, value):
    with pytest.raises(InvalidRequest) as info:
        parse(**{field: value})
    assert info.value.status == 400 and info.value.param == field


def test_json_response_formats_carry_their_schema_into_the_sampling():
    assert parse(response_format={"type": "text"}).sampling().json_schema is None
    assert json.loads(parse(response_format={"type": "json_object"}).sampling().json_schema) == {"type": "object"}
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    assert json.loads(parse(response_format=fmt).sampling().json_schema) == {**schema, "additionalProperties": False}
    # what the grammar decodes under: a subset of what the schema allows (decoding_schema)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_object", "json_schema": {"name": "x"}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "response_format.json_schema.schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_a_bad_response_format_is_400_naming_the_field(fmt, param):
    with pytest.raises(InvalidRequest) as info:
        parse(response_format=fmt)
    assert info.value.status == 400 and info.value.param == param


def test_objects_of_a_schema_are_closed_to_unlisted_keys_at_every_depth_unless_they_allow_them():
    from meshnet.protocol.structured import decoding_schema as closed_objects
    schema = {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        "either": {"anyOf": [{"type": "object", "properties": {"x": {"type": "number"}}}, {"type": "null"}]},
        "ref": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["city"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] is True  # said so: kept
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["Point"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    assert closed_objects({"type": "object"}) == {"type": "object"}  # no properties: any object


def test_numbers_are_decoded_with_bounded_digits_unless_their_schema_bounds_them():
    from meshnet.protocol.structured import decoding_schema
    schema = {"type": "object", "properties": {
        "price": {"type": "number"}, "count": {"type": "integer", "minimum": 0},
        "ratio": {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 1}}}
    props = decoding_schema(schema)["properties"]
    assert props["price"] == {"type": "number", "multipleOf": 1e-6, "minimum": -10**15, "maximum": 10**15}
    assert props["count"] == {"type": "integer", "minimum": 0, "maximum": 10**15}
    assert props["ratio"] == {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 1, "minimum": -10**15}


@pytest.mark.parametrize("fields, total", [({"n": 8, "max_tokens": 8192}, "65,536"),
                                           ({"n": 5, "max_completion_tokens": 8000}, "40,000"),
                                           ({"n": 128, "max_tokens": 257}, "32,896")])
def test_a_request_asking_for_more_than_its_share_of_tokens_is_400_naming_max_tokens(fields, total):
    error = refusal(**fields)
    assert error.param == "max_tokens" and error.code == "invalid_field"
    assert f"asks for {total} tokens; at most 32,768 per request" in error.message


def test_the_token_bound_admits_every_default():
    assert parse(n=128).n == 128  # 128 × the default 256 is the bound itself
    assert parse(n=4, max_tokens=8192).sampling().max_tokens == 8192
