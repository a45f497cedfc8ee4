"""OpenAI's legacy text completions (``POST /v1/completions``) over the same mesh as chat.

A prompt is raw text (tokenized with the model's own special tokens, as a completion API does:
no chat template) or a list of token ids; each prompt runs ``n`` choices through the same
generation loop, streaming and stop strings as chat (:mod:`meshnet.gateway.openai_api`).
Several prompts run one after the other; their choices are numbered prompt by prompt.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from starlette.responses import Response

from meshnet.cpu import off_loop
from meshnet.drain import EventStream
from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.gateway.openai_api import choices_for, choice_deltas, fit_context, meshnet_block, token_text
from meshnet.gateway.pipeline import GenerationStats, Orchestrator
from meshnet.protocol.http import sse_error
from meshnet.protocol.completions import CompletionRequest
from meshnet.protocol.openai import SamplingParams


def prompt_ids(orchestrator: Orchestrator, prompt: str | list[int], index: int) -> list[int]:
    """Token ids of one prompt: a text tokenized as the model's tokenizer does with its special
    tokens (a BOS where the model adds one), or token ids checked against the vocabulary. CPU-bound.

    Raises:
        InvalidRequest: a token id outside the vocabulary.
    """
    if isinstance(prompt, str):
        return list(orchestrator.tokenizer(prompt, add_special_tokens=True)["input_ids"])
    bad = [i for i in prompt if not 0 <= i < orchestrator.vocab_size]
    if bad:
        raise InvalidRequest(f"invalid field 'prompt': token id {bad[0]} of prompt {index} is outside the vocabulary "
                             f"(0..{orchestrator.vocab_size - 1})", code="invalid_field", param="prompt")
    return list(prompt)


def completion_logprobs(orchestrator: Orchestrator, stats: GenerationStats, offset: int,
                        prompt: dict | None = None) -> dict:
    """OpenAI's completion ``logprobs``: each token's text, its log-probability, the most likely
    tokens' (``{text: logprob}``) and its character offset in the choice's text (from ``offset``);
    after ``prompt``'s (:func:`prompt_logprobs`) when the prompt is echoed."""
    out = prompt_logprobs(orchestrator, [e.token_id for e in stats.logprobs], stats.logprobs, offset)
    if prompt is None:
        return out
    return {key: prompt[key] + out[key] for key in out}


def prompt_logprobs(orchestrator: Orchestrator, ids: list[int], scores: list, offset: int = 0) -> dict:
    """:func:`completion_logprobs` of tokens ``ids`` with their ``scores``
    (:class:`~meshnet.gateway.entry.TokenLogprob`, or None for the prompt's first token: its
    ``token_logprobs`` and ``top_logprobs`` entries are null, as in OpenAI's API)."""
    tokens, offsets = [], []
    for token_id in ids:
        offsets.append(offset)
        tokens.append(token_text(orchestrator.tokenizer, token_id))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in scores],
            "top_logprobs": [None if e is None else {token_text(orchestrator.tokenizer, t): lp for t, lp in e.top}
                             for e in scores],
            "text_offset": offsets}


async def _echoed_logprobs(orchestrator: Orchestrator, req: CompletionRequest, ids: list[int]) -> dict | None:
    """The echoed prompt's ``logprobs`` (one prefill through the mesh, :meth:`Orchestrator.score`),
    or None unless the request has both ``echo`` and ``logprobs``."""
    if not (req.echo and req.logprobs is not None):
        return None
    return prompt_logprobs(orchestrator, ids, await orchestrator.score(ids, req.logprobs))


def _usage(prompts: list[list[int]], stats: list[GenerationStats]) -> dict:
    prompt, completion = sum(len(p) for p in prompts), sum(s.completion_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _prepare(orchestrator: Orchestrator, req: CompletionRequest) -> tuple[list[list[int]], list[str],
                                                                                 list[SamplingParams]]:
    """Each prompt's ids, its echo text ("" without ``echo``) and its choice-0 settings fitted to the context."""
    prompts = [await off_loop(prompt_ids, orchestrator, p, i) for i, p in enumerate(req.prompts())]
    echoes = [(p if isinstance(p, str) else orchestrator.tokenizer.decode(ids)) if req.echo else ""
              for p, ids in zip(req.prompts(), prompts)]
    return prompts, echoes, [fit_context(orchestrator, ids, req.sampling()) for ids in prompts]


async def complete(orchestrator: Orchestrator, model: str, req: CompletionRequest, disconnected=None) -> Response:
    """Non-streaming text completion: ``n`` choices per prompt, ``usage`` and the ``meshnet`` block."""
    arrived_s = time.perf_counter()
    prompts, echoes, params = await _prepare(orchestrator, req)
    choices, all_stats = [], []
    for p, (ids, echo, first) in enumerate(zip(prompts, echoes, params)):
        params_n, stats = choices_for(first, req.n, arrived_s)
        for s in stats:
            s.prompt_tokens = len(ids)
        echoed = await _echoed_logprobs(orchestrator, req, ids)
        texts = [""] * req.n
        if req.max_tokens:
            async for i, piece, _ in choice_deltas(orchestrator, ids, params_n, stats, disconnected):
                texts[i] += piece or ""
        for i, s in enumerate(stats):
            logprobs = None if req.logprobs is None else completion_logprobs(orchestrator, s, len(echo), echoed)
            choices.append({"text": echo + texts[i], "index": p * req.n + i, "logprobs": logprobs,
                            "finish_reason": s.finish_reason})
        all_stats += stats
    body = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(prompts, all_stats),
            "meshnet": meshnet_block(all_stats)}
    return Response(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
                    media_type="application/json")


async def stream(orchestrator: Orchestrator, model: str, req: CompletionRequest) -> EventStream:
    """Server-sent events of ``text_completion`` chunks ending with ``data: [DONE]``: the echoed
    prompt first (with ``echo``), then text pieces, then each choice's ``finish_reason`` (with its
    ``logprobs`` when asked); usage once,
    in a last chunk without choices, only with ``stream_options.include_usage``. An error after the
    first event is sent as an ``{"error": ...}`` event."""
    cid, created, arrived_s = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), time.perf_counter()
    prompts, echoes, params = await _prepare(orchestrator, req)  # a bad prompt is a 400 before any event
    include_usage = req.stream_options is not None and req.stream_options.include_usage

    def chunk(index: int | None, text: str = "", finish: str | None = None, logprobs=None, **extra) -> str:
        choices = [] if index is None else [{"text": text, "index": index, "logprobs": logprobs,
                                             "finish_reason": finish}]
        body = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                **({"usage": None} if include_usage else {}), **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events() -> AsyncIterator[str]:
        all_stats: list[GenerationStats] = []
        try:
            for p, (ids, echo, first) in enumerate(zip(prompts, echoes, params)):
                params_n, stats = choices_for(first, req.n, arrived_s)
                for s in stats:
                    s.prompt_tokens = len(ids)
                all_stats += stats
                if echo:
                    echoed = await _echoed_logprobs(orchestrator, req, ids)
                    for i in range(req.n):
                        yield chunk(p * req.n + i, echo, logprobs=echoed)
                if not req.max_tokens:
                    for i in range(req.n):
                        yield chunk(p * req.n + i, "", "length")
                    continue
                async for i, piece, _ in choice_deltas(orchestrator, ids, params_n, stats):
                    if piece is not None:
                        yield chunk(p * req.n + i, piece)
                    else:
                        logprobs = None if req.logprobs is None else completion_logprobs(orchestrator, stats[i], 0)
                        yield chunk(p * req.n + i, "", stats[i].finish_reason, logprobs)
        except MeshnetError as exc:
            yield sse_error(exc)
            return
        if include_usage:
            yield chunk(None, usage=_usage(prompts, all_stats))
        yield "data: [DONE]\n\n"

    return EventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
