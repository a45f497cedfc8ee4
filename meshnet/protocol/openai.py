"""OpenAI chat request schema: torch-free, shared by the tracker and entry nodes.

Every parameter meshnet accepts is honoured; every other one is refused (see
:class:`ChatRequest`). Chat bodies are judged as OpenAI does: any bad or unsupported
parameter is a 400 whose ``error.param`` names it. The control-plane payloads (register,
heartbeat, ...) keep 422 for a field that fails validation.
"""

from __future__ import annotations

import json

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from meshnet.errors import InvalidRequest, NotFound
from meshnet.cpu import off_loop
from meshnet.protocol.http import validate_json
from meshnet.protocol.structured import FunctionCall, JsonSchemaFormat, NamedFunction, NamedToolChoice, Strict, Tool, \
    ToolCall, ToolFunction, call_schema, decoding_schema, legacy_call_id

#: largest ``seed``: torch.Generator.manual_seed takes 64-bit values, and choice ``i`` of an
#: ``n``-choice request uses ``(seed + i) mod 2**63``, so seeds live in [0, 2**63 - 1]
SEED_MAX = 2**63 - 1
#: most choices per request (OpenAI's bound); each choice is a whole generation across the route,
#: run :data:`meshnet.gateway.openai_api.CHOICES_AT_ONCE` at a time
N_MAX = 128
#: most tokens one request may ask for in all: choices × prompts × ``max_tokens`` (ADR-0060). The
#: defaults fit (``n`` = 128 × 256); ``n`` = 8 × ``max_tokens`` = 8192 does not: one request would
#: hold a session for 65,536 decode steps
MAX_REQUEST_TOKENS = 32_768
#: OpenAI's bound on ``top_logprobs``
TOP_LOGPROBS_MAX = 20
#: bodies above this many bytes are parsed in a worker thread, not on the event loop
PARSE_OFF_LOOP_BYTES = 64 * 1024

#: OpenAI chat parameters meshnet does not implement, with what they would ask for. Sending any
#: of them (other than ``null``) is a 400 ``unsupported_parameter`` naming it: silently dropping
#: a parameter would return an answer the client did not ask for.
UNSUPPORTED = {
    "audio": "audio output", "modalities": "output modalities other than text",
    "prediction": "predicted outputs", "web_search_options": "web search",
    "reasoning_effort": "reasoning models", "service_tier": "service tiers",
    "metadata": "stored completions (meshnet stores nothing)", "verbosity": "verbosity control",
}


@dataclass(frozen=True)
class SamplingParams:
    """Generation settings of one choice (OpenAI names and ranges).

    ``temperature`` 0 = greedy. ``frequency_penalty``/``presence_penalty`` in [-2, 2] and
    ``logit_bias`` (token id, bias in [-100, 100]) adjust the logits as in OpenAI's API
    reference (see :func:`meshnet.node.entry.adjust_logits`). ``top_logprobs`` is None
    when no log-probabilities are wanted, else 0..20 alternatives per token. ``json_schema`` (JSON
    text, None: free text) constrains the output to JSON valid under that schema (ADR-0053).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int | None = None
    json_schema: str | None = None


def _invalid(field: str, why: str) -> InvalidRequest:
    """A 400 about ``field`` from a check across fields (pydantic passes it through)."""
    return InvalidRequest(f"invalid field '{field}': {field} {why}", code="invalid_field", param=field)


def _unsupported(what: str) -> PydanticCustomError:
    """A validation error that maps to 400 ``unsupported_parameter`` (see :func:`validate_json`)."""
    return PydanticCustomError("unsupported", "meshnet does not support {what}", {"what": what})


class ChatMessage(Strict):
    """One message, as OpenAI's API accepts it: ``name`` (the template may render it) and an
    assistant's earlier ``refusal`` are taken, explicit ``null``s count as not sent. An assistant
    message may carry ``tool_calls`` (its ``content`` then may be null); a ``tool`` message answers
    the call named by its ``tool_call_id``. The legacy shapes are taken as those: an assistant's
    ``function_call`` is one tool call, a ``function`` message (its ``name`` the function's) the
    tool's answer to it (:func:`legacy_call_id` pairs them)."""

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None

    @model_validator(mode="after")
    def _legacy(self):
        if self.function_call is not None:
            if self.role != "assistant" or self.tool_calls:
                raise ValueError("function_call is only on assistant messages, without tool_calls")
            self.tool_calls = [ToolCall(id=legacy_call_id(self.function_call.name), function=self.function_call)]
            self.function_call = None
        if self.role == "function":
            if not self.name:
                raise ValueError("a function message needs the name of the function it answers")
            self.role, self.tool_call_id, self.name = "tool", legacy_call_id(self.name), None
        return self

    @model_validator(mode="after")
    def _shape(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls are only on assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, value):
        """OpenAI clients may send ``[{"type": "text", "text": ...}, ...]``: joined into one
        string. Other part types (images, audio, files) are refused: meshnet models read text."""
        if not isinstance(value, list):
            return value
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise _unsupported(f"content part {i} of type {kind!r} (meshnet models read text parts only)")
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise _unsupported(f"field {extra[0]!r} of content part {i}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} needs a 'text' string")
            texts.append(part["text"])
        return "".join(texts)

    @field_validator("content")
    @classmethod
    def _unicode(cls, value: str | None) -> str | None:
        """Text the tokenizer can read: a lone UTF-16 surrogate (``"\\ud800"`` in the JSON) is no
        character, and is refused here rather than failing inside the tokenizer."""
        if value is None:
            return value
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"not valid Unicode text: a lone surrogate {value[exc.start]!r} at character "
                             f"{exc.start}") from None
        return value


#: the schema of ``response_format: {"type": "json_object"}``: any JSON object
ANY_OBJECT = {"type": "object"}


class ResponseFormat(Strict):
    """``text`` (free text), ``json_object`` (a JSON object) or ``json_schema`` (JSON valid under the
    given schema, decoded under :func:`decoding_schema`):
    the two JSON kinds decode under a grammar (llguidance, ADR-0053), so the output always parses,
    unless ``max_tokens`` cuts it (``finish_reason: "length"``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise _invalid("response_format.json_schema", "is required with type json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise _invalid("response_format.json_schema", "is only allowed with type json_schema")
        schema = self.schema()
        if schema is not None:
            import llguidance

            error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
            if error:
                raise InvalidRequest(f"invalid field 'response_format.json_schema.schema': {error}",
                                     code="invalid_field", param="response_format.json_schema.schema")
        return self

    def schema(self) -> dict | None:
        """The JSON Schema the output must satisfy (None: free text)."""
        if self.type == "json_object":
            return ANY_OBJECT
        if self.type == "json_schema":
            return decoding_schema(self.json_schema.schema_) if self.json_schema.schema_ else ANY_OBJECT
        return None


class StreamOptions(Strict):
    include_usage: bool = False


class _Generation(Strict):
    """The sampling and streaming fields chat and text completions share, validated once.

    ``null`` counts as not sent, as in OpenAI's API; a parameter in the subclass's ``unsupported``
    map (other than ``null``) is a 400 ``unsupported_parameter`` naming it.
    """

    unsupported: ClassVar[dict[str, str]] = {}

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    n: StrictInt = Field(default=1, ge=1, le=N_MAX)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        """``null`` means not sent; a known-but-unsupported parameter gets its own message."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        for name, what in cls.unsupported.items():
            if name in data:
                raise InvalidRequest(f"unsupported parameter '{name}': meshnet does not support {what}",
                                     code="unsupported_parameter", param=name)
        return data

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty (an empty one would end every answer at once)")
        return value

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, value):
        if value is not None and not 0 <= value <= SEED_MAX:
            raise ValueError(f"seed must lie in [0, 2**63 - 1] = [0, {SEED_MAX}], got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_map(cls, value):
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys are token ids as decimal strings, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {key} is {bias}; biases lie in [-100, 100]")
        return value

    def _check_total(self, max_tokens: int, prompts: int = 1) -> None:
        """Refuse a request asking for more than :data:`MAX_REQUEST_TOKENS` in all.

        Raises:
            InvalidRequest (400, param ``max_tokens``): ``n`` × prompts × ``max_tokens`` is over it.
        """
        total = self.n * prompts * max_tokens
        if total > MAX_REQUEST_TOKENS:
            shape = f"n ({self.n})" + (f" × prompts ({prompts})" if prompts > 1 else "")
            raise _invalid("max_tokens", f"× {shape} asks for {total:,} tokens; at most {MAX_REQUEST_TOKENS:,} "
                                         f"per request (send several requests, or fewer choices)")

    def _sampling(self, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              stop=stop, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, logit_bias=bias, top_logprobs=top_logprobs)


class ChatRequest(_Generation):
    """OpenAI's chat completion request, as far as meshnet implements it.

    Honoured: ``model``, ``messages``, ``max_tokens``/``max_completion_tokens``, ``temperature``,
    ``top_p``, ``seed`` (0..2**63-1), ``stop`` (1-4 non-empty strings), ``n`` (1..8),
    ``logprobs``/``top_logprobs`` (0..20), ``frequency_penalty``/``presence_penalty`` ([-2, 2]),
    ``logit_bias`` (token id → [-100, 100]), ``stream``, ``stream_options.include_usage``,
    ``response_format`` of type ``text``, and meshnet's ``pipelined_prefill``.

    Accepted because they cannot change the answer: ``user`` (an end-user id OpenAI uses for
    abuse monitoring; meshnet keeps no per-user state) and ``store: false`` (meshnet stores
    nothing; ``store: true`` is refused).

    Everything else is a 400 naming the field: the parameters in :data:`UNSUPPORTED` and any
    unknown field. ``null`` counts as not sent, as in OpenAI's API.
    """

    unsupported: ClassVar[dict[str, str]] = UNSUPPORTED

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=8192)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=8192)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=TOP_LOGPROBS_MAX)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: the legacy function calling: ``functions`` are tools, ``function_call`` their choice; the
    #: answer then carries one ``function_call`` (finish reason ``function_call``), not ``tool_calls``
    functions: list[ToolFunction] | None = Field(default=None, min_length=1, max_length=128)
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    store: bool | None = None
    #: meshnet extension: turn pipelined prefill off for this request (benchmarks compare both)
    pipelined_prefill: bool | None = None

    @field_validator("store")
    @classmethod
    def _store_nothing(cls, value):
        if value:
            raise _unsupported("stored completions (store: true)")
        return value

    @property
    def legacy_functions(self) -> bool:
        """The request used ``functions`` (answer in the legacy shape)."""
        return self.functions is not None

    @model_validator(mode="after")
    def _functions_as_tools(self):
        if self.function_call is not None and self.functions is None:
            raise _invalid("function_call", "needs functions")
        if self.functions is not None:
            if self.tools is not None or self.tool_choice is not None:
                raise _invalid("functions", "send either functions (legacy) or tools, not both")
            self.tools = [Tool(type="function", function=f) for f in self.functions]
            choice = self.function_call
            self.tool_choice = NamedToolChoice(type="function", function=choice) \
                if isinstance(choice, NamedFunction) else choice
            self.parallel_tool_calls = False  # the legacy answer holds one call
        return self

    @model_validator(mode="after")
    def _dependent_fields(self):
        self._check_total(self.max_completion_tokens or self.max_tokens or 256)
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs", "needs logprobs: true")
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options", "is only allowed with stream: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise _invalid("tool_choice", "needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise _invalid("tool_choice", f"names {self.tool_choice.function.name!r}, which is not in tools")
        if self.forced_tools() and self.response_format is not None and self.response_format.type != "text":
            raise _invalid("response_format", "cannot constrain an answer that must be a tool call")
        return self

    def calling_tools(self) -> list[Tool]:
        """The tools the model may call in this answer (none with ``tool_choice: "none"``)."""
        return [] if not self.tools or self.tool_choice == "none" else list(self.tools)

    def forced_tools(self) -> list[Tool]:
        """The tools one of which the answer must call (``required``: any; a named one: it), else []."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools or []) if self.tool_choice == "required" else []

    def sampling(self) -> SamplingParams:
        """Settings of choice 0 (:meth:`for_choice` derives the others). A forced tool call decodes
        under its call's schema (``{"name": ..., "arguments": {...}}``, ADR-0053)."""
        forced = self.forced_tools()
        if forced:
            params = self._sampling(self.max_completion_tokens or self.max_tokens or 256,
                                    (self.top_logprobs or 0) if self.logprobs else None)
            return replace(params, json_schema=json.dumps(call_schema(forced), sort_keys=True))
        params = self._sampling(self.max_completion_tokens or self.max_tokens or 256,
                                (self.top_logprobs or 0) if self.logprobs else None)
        schema = None if self.response_format is None else self.response_format.schema()
        return params if schema is None else replace(params, json_schema=json.dumps(schema, sort_keys=True))


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """Settings of choice ``index`` of an ``n``-choice request: its own generator, seeded with
    ``(seed + index) mod 2**63`` so that every choice of a seeded request is reproducible and
    the choices differ from each other."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=(params.seed + index) % (SEED_MAX + 1))


def parse_chat_request(body: bytes) -> ChatRequest:
    """Validate a chat completion body; every failure is a 400 naming the field (see
    :func:`validate_json`)."""
    return validate_json(ChatRequest, body, status=400, unknown_is_unsupported=True)


async def read_chat_request(body: bytes) -> ChatRequest:
    """:func:`parse_chat_request`, in the request thread pool when the body is over
    :data:`PARSE_OFF_LOOP_BYTES`, so that JSON of a huge body never blocks the event loop."""
    if len(body) > PARSE_OFF_LOOP_BYTES:
        return await off_loop(parse_chat_request, body)
    return parse_chat_request(body)


def model_entry(name: str, created: float, **extra) -> dict:
    """One entry of ``GET /v1/models`` (OpenAI's model object): ``id``, ``object``, ``created`` (unix
    seconds: when this process first served the model), ``owned_by``, and meshnet's ``extra`` fields."""
    return {"id": name, "object": "model", "created": int(created), "owned_by": "meshnet", **extra}


def find_model(entries: list[dict], asked: str, canonical: str) -> dict:
    """The entry of ``GET /v1/models/{id}``: the one of ``entries`` whose id is ``canonical`` (the
    asked name or alias resolved).

    Raises:
        NotFound: 404 ``model_not_found`` naming ``asked``.
    """
    entry = next((e for e in entries if e["id"] == canonical), None)
    if entry is None:
        raise model_not_found(asked)
    return entry


def model_not_found(name: str) -> NotFound:
    """The 404 of ``GET /v1/models/{id}`` for a model this process does not serve (OpenAI's code)."""
    return NotFound(f"the model {name!r} does not exist here", code="model_not_found", param="model",
                    hint="GET /v1/models lists the models served")
