"""OpenAI-compatible chat surface: request validation, text streaming, response shapes.

One Starlette handler serves ``POST /v1/chat/completions`` at every entry node; the
tracker forwards the same body to an entry node. Validation is pydantic v2, so a bad
field yields a 422 naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.gateway.pipeline import GenerationStats, Orchestrator
from meshnet.gateway.schema import ChatRequest, SamplingParams, error_response, parse_chat_request

__all__ = ["complete", "stream", "text_deltas", "read_chat", "error_response", "parse_chat_request"]


def fit_context(orchestrator: Orchestrator, prompt: list[int], params: SamplingParams) -> SamplingParams:
    """Clip ``max_tokens`` to the model's context (``max_position_embeddings``).

    Raises:
        InvalidRequest: the prompt alone fills the context (400 ``context_length_exceeded``).
    """
    limit = int(getattr(orchestrator.slot.shard.config, "max_position_embeddings", 0) or 0)
    if not limit:
        return params
    if len(prompt) >= limit:
        raise InvalidRequest(f"prompt is {len(prompt)} tokens; the model's context is {limit} tokens",
                             code="context_length_exceeded", hint="shorten the messages")
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, limit - len(prompt)))


async def text_deltas(orchestrator: Orchestrator, prompt: list[int], params: SamplingParams,
                      stats: GenerationStats, disconnected=None) -> AsyncIterator[str]:
    """Yield text pieces as tokens arrive, honouring ``stop`` strings.

    Text is re-decoded from all generated ids each step so multi-byte characters split
    across tokens come out whole; a stop string ends the generation and is not emitted.
    ``disconnected`` (async, optional) is polled every token: a client that went away
    stops the generation, which frees its sessions on every hop. ``params`` are already
    fitted to the context by :func:`fit_context`.
    """
    tokenizer = orchestrator.tokenizer
    ids: list[int] = []
    sent = 0
    hold = max((len(s) for s in params.stop), default=0)
    async with contextlib.aclosing(orchestrator.generate(prompt, params, stats)) as tokens:
        async for token in tokens:
            if disconnected is not None and await disconnected():
                stats.finish_reason = "cancelled"
                return
            ids.append(token)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            for stop in params.stop:
                cut = text.find(stop)
                if cut != -1:
                    stats.finish_reason = "stop"
                    if cut > sent:
                        yield text[sent:cut]
                    return
            if len(text) - hold > sent:
                yield text[sent:len(text) - hold]
                sent = len(text) - hold
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if len(text) > sent:
        yield text[sent:]


def meshnet_block(stats: GenerationStats) -> dict:
    """The ``meshnet`` object of a response: route used and measured speeds."""
    return {"route": [h.to_json() for h in stats.route], "prefill_s": round(stats.prefill_s, 4),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3), "failovers": stats.failovers,
            "completion_token_ids": stats.token_ids}


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


async def complete(orchestrator: Orchestrator, model: str, req: ChatRequest,
                   disconnected=None) -> JSONResponse:
    """Non-streaming completion: the whole text plus ``usage`` and the ``meshnet`` block."""
    stats = GenerationStats()
    prompt = orchestrator.encode_chat([m.model_dump() for m in req.messages])
    params = fit_context(orchestrator, prompt, req.sampling())
    text = "".join([piece async for piece in text_deltas(orchestrator, prompt, params, stats, disconnected)])
    return JSONResponse({
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": stats.finish_reason}],
        "usage": usage(stats), "meshnet": meshnet_block(stats)})


def stream(orchestrator: Orchestrator, model: str, req: ChatRequest) -> StreamingResponse:
    """Server-sent events in OpenAI's chunk shape, ending with ``data: [DONE]``."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    prompt = orchestrator.encode_chat([m.model_dump() for m in req.messages])
    params = fit_context(orchestrator, prompt, req.sampling())  # a too-long prompt is a 400 before any event

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        stats = GenerationStats()
        yield chunk({"role": "assistant", "content": ""})
        try:
            async for piece in text_deltas(orchestrator, prompt, params, stats):
                yield chunk({"content": piece})
        except MeshnetError as exc:
            yield f"data: {json.dumps(exc.to_envelope())}\n\n"
            return
        yield chunk({}, stats.finish_reason, usage=usage(stats), meshnet=meshnet_block(stats))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def read_chat(request: Request) -> ChatRequest:
    return parse_chat_request(await request.body())
