"""OpenAI's legacy text completion request (``POST /v1/completions``), validated as chat's is:
the sampling fields and their checks are :class:`meshnet.protocol.openai._Generation`'s."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from meshnet.cpu import off_loop
from meshnet.protocol.http import validate_json
from meshnet.protocol.openai import PARSE_OFF_LOOP_BYTES, SamplingParams, _Generation, _invalid

#: most log-probabilities per token a text completion returns (OpenAI's ``logprobs`` bound)
COMPLETION_LOGPROBS_MAX = 5


class CompletionRequest(_Generation):
    """OpenAI's legacy text completion request (``POST /v1/completions``).

    ``prompt`` is a string, a list of strings, a list of token ids or a list of such lists; each
    prompt gets ``n`` choices, indexed prompt by prompt. ``echo`` puts the prompt's text before
    each completion; ``logprobs`` (0..5) returns the chosen token's and the most likely tokens'
    log-probabilities of each completion token, and with ``echo`` of each prompt token too (the
    first one null, as OpenAI does). ``max_tokens`` defaults to 16 as in OpenAI's API and may be 0
    only with ``echo`` (scoring a prompt). Refused with a 400: ``suffix`` and ``best_of`` (other
    than 1).
    """

    unsupported: ClassVar[dict[str, str]] = {"suffix": "suffixes (insertion)"}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: StrictInt = Field(default=16, ge=0, le=8192)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=COMPLETION_LOGPROBS_MAX)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        prompts = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("needs at least one non-empty prompt")
        for p in prompts:
            if isinstance(p, str):
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"not valid Unicode text: a lone surrogate at character {exc.start}") from None
        return value

    @model_validator(mode="after")
    def _dependent_fields(self):
        if self.max_tokens == 0 and not self.echo:
            raise _invalid("max_tokens", "may be 0 only with echo: true (scoring a prompt)")
        self._check_total(self.max_tokens, len(self.prompts()))
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options", "is only allowed with stream: true")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def sampling(self) -> SamplingParams:
        """Settings of choice 0 of each prompt (:meth:`for_choice` derives the others)."""
        return self._sampling(self.max_tokens, self.logprobs)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Validate a text completion body; every failure is a 400 naming the field."""
    return validate_json(CompletionRequest, body, status=400, unknown_is_unsupported=True)


async def read_completion_request(body: bytes) -> CompletionRequest:
    """:func:`parse_completion_request`, off the event loop for a big body (see :func:`read_chat_request`)."""
    if len(body) > PARSE_OFF_LOOP_BYTES:
        return await off_loop(parse_completion_request, body)
    return parse_completion_request(body)
