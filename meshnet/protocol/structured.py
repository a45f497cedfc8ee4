"""Tools, tool calls and JSON Schemas of a chat request: the parts of the OpenAI schema that
tool calling and structured outputs use (ADR-0053). Torch-free.

:func:`decoding_schema` is what the grammar decodes under (objects closed, numbers bounded);
:func:`call_schema` the schema of one call of one of a request's tools.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    """Unknown fields are refused, not ignored (``extra="forbid"``)."""

    model_config = ConfigDict(extra="forbid")


class FunctionCall(Strict):
    """A call the assistant made: the function's ``name`` and its ``arguments`` as JSON text."""

    name: str
    arguments: str


class ToolCall(Strict):
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def legacy_call_id(name: str) -> str:
    """The id a legacy ``function_call`` of ``name`` gets (the legacy API has none; templates
    need one to pair a call with its result, and Mistral's wants nine letters and digits)."""
    return "f" + hashlib.sha1(name.encode()).hexdigest()[:8]


class ToolFunction(Strict):
    """A function the model may call: its ``name``, what it does, and its arguments' JSON Schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    """``tool_choice`` naming one function: the answer is a call of it."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    """``response_format.json_schema``: a name, the JSON Schema the output must satisfy, and
    ``strict`` (output always satisfies the schema here: the decoding is constrained)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


#: the keywords whose values are schemas, or lists or maps of schemas (JSON Schema 2020-12 and draft 7)
_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


#: a number the grammar lets a model write has at most this many decimals and an absolute value
#: below :data:`NUMBER_BOUND`, unless its schema says otherwise (:func:`decoding_schema`)
NUMBER_STEP = 1e-6
NUMBER_BOUND = 10**15


def decoding_schema(schema):
    """The schema a grammar decodes ``schema`` under: a subset of the values it allows, every one
    of which it still allows, with no way to run on until ``max_tokens`` cuts the JSON (a small
    model under a grammar otherwise invents keys, or writes digits forever:
    ``1.1111123456789…``):

    - an object schema with ``properties`` that does not say whether other keys are allowed
      allows none, at any depth (as OpenAI's strict structured outputs and function calling
      require of a schema; ``additionalProperties: true`` keeps them allowed);
    - a ``number`` without ``multipleOf`` gets ``multipleOf`` :data:`NUMBER_STEP` (at most six
      decimals, no exponent), and a number or ``integer`` without a lower or upper bound gets
      ±:data:`NUMBER_BOUND`.

    Returns a new schema; the given one is not changed."""
    if isinstance(schema, list):
        return [decoding_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: decoding_schema(s) for name, s in value.items()}
        elif key in _SUBSCHEMAS or key in _SCHEMA_LISTS:
            out[key] = decoding_schema(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and out.get("type", "object") == "object":
        out["additionalProperties"] = False
    if out.get("type") in ("number", "integer"):
        if out["type"] == "number" and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -NUMBER_BOUND
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = NUMBER_BOUND
    return out


def _arguments(parameters: dict | None) -> dict:
    """A tool's arguments schema for constrained decoding (:func:`decoding_schema`)."""
    if not parameters:
        return {"type": "object"}
    return decoding_schema(parameters)


def call_schema(tools: list[Tool]) -> dict:
    """The JSON Schema of one call of one of ``tools``: ``{"name": <its name>, "arguments": <its
    parameters>}`` (any object where a tool gives no parameters)."""
    options = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                 "arguments": _arguments(t.function.parameters)},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}
