"""OpenAI-compatible chat surface: request validation, text streaming, response shapes.

One Starlette handler serves ``POST /v1/chat/completions`` at every entry node; the
tracker forwards the same body to an entry node. Validation is pydantic v2, so a bad
field yields a 422 naming it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from meshnet.errors import MeshnetError
from meshnet.gateway.hops import hop_to_json
from meshnet.gateway.pipeline import GenerationStats, Orchestrator
from meshnet.gateway.schema import ChatRequest, SamplingParams, error_response, parse_chat_request

__all__ = ["complete", "stream", "text_deltas", "read_chat", "error_response", "parse_chat_request"]


async def text_deltas(orchestrator: Orchestrator, prompt: list[int], params: SamplingParams,
                      stats: GenerationStats) -> AsyncIterator[str]:
    """Yield text pieces as tokens arrive, honouring ``stop`` strings.

    Text is re-decoded from all generated ids each step so multi-byte characters split
    across tokens come out whole; a stop string ends the generation and is not emitted.
    """
    tokenizer = orchestrator.tokenizer
    ids: list[int] = []
    sent = 0
    hold = max((len(s) for s in params.stop), default=0)
    async for token in orchestrator.generate(prompt, params, stats):
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
        safe = len(text) - hold
        if safe > sent:
            yield text[sent:safe]
            sent = safe
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if len(text) > sent:
        yield text[sent:]


def meshnet_block(stats: GenerationStats) -> dict:
    """The ``meshnet`` object of a response: route used and measured speeds."""
    return {"route": [hop_to_json(h) for h in stats.route], "prefill_s": round(stats.prefill_s, 4),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3), "failovers": stats.failovers,
            "completion_token_ids": stats.token_ids}


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


async def complete(orchestrator: Orchestrator, model: str, req: ChatRequest) -> JSONResponse:
    """Non-streaming completion: the whole text plus ``usage`` and the ``meshnet`` block."""
    stats = GenerationStats()
    prompt = orchestrator.encode_chat([m.model_dump() for m in req.messages])
    text = "".join([piece async for piece in text_deltas(orchestrator, prompt, req.sampling(), stats)])
    return JSONResponse({
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": stats.finish_reason}],
        "usage": usage(stats), "meshnet": meshnet_block(stats)})


def stream(orchestrator: Orchestrator, model: str, req: ChatRequest) -> StreamingResponse:
    """Server-sent events in OpenAI's chunk shape, ending with ``data: [DONE]``."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        stats = GenerationStats()
        yield chunk({"role": "assistant", "content": ""})
        try:
            prompt = orchestrator.encode_chat([m.model_dump() for m in req.messages])
            async for piece in text_deltas(orchestrator, prompt, req.sampling(), stats):
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
