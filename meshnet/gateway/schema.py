"""OpenAI chat request schema and the error envelope: torch-free, shared by tracker and nodes.

Validation is pydantic v2, so a bad field yields a 422 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.responses import JSONResponse

from meshnet.errors import InvalidRequest, MeshnetError


@dataclass(frozen=True)
class SamplingParams:
    """Request-level generation settings (OpenAI names). ``temperature`` 0 = greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class TextPart(BaseModel):
    """One part of a multi-part message; meshnet models read text parts only."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _join_parts(cls, value):
        """OpenAI clients may send ``[{"type": "text", "text": ...}, ...]``: joined into one string."""
        return value if isinstance(value, str) else "".join(part.text for part in value)


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat request meshnet honours (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    #: meshnet extension: turn pipelined prefill off for this request (benchmarks compare both)
    pipelined_prefill: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.max_completion_tokens or self.max_tokens or 256,
                              temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=stop)


def validate_json(model: type[BaseModel], body: bytes):
    """Parse and validate a JSON body into ``model``.

    Raises:
        InvalidRequest: not JSON (400), or a field fails validation (422, the field named).
    """
    try:
        data = json.loads(body or b"{}")
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise InvalidRequest(f"invalid field '{field}': {err['msg']}", code="invalid_field", status=422) from exc


def parse_chat_request(body: bytes) -> ChatRequest:
    """Validate a chat completion body (see :func:`validate_json`)."""
    return validate_json(ChatRequest, body)


def error_response(exc: MeshnetError) -> JSONResponse:
    """The one mapping of a :class:`MeshnetError` to an HTTP response."""
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return JSONResponse(exc.to_envelope(), status_code=exc.status, headers=headers)


