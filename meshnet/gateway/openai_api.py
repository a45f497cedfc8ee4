"""OpenAI-compatible chat surface: request preparation, text streaming, response shapes.

One Starlette handler serves ``POST /v1/chat/completions`` at every entry node; the
tracker forwards the same body to an entry node. The request schema (what is honoured,
what is refused) is :class:`meshnet.protocol.openai.ChatRequest`.

CPU work stays off the event loop: big bodies are parsed, every prompt is rendered and
tokenized, and non-streamed responses are serialised in the request pool
(:mod:`meshnet.cpu`); logits and sampling run in the orchestrator's worker thread;
text is decoded incrementally (:class:`TextDecoder`: each new token re-decodes only a short
window of recent ids, so ``n`` tokens cost O(n) decoding, not the O(n²) of decoding everything
again at every step), and single tokens' text and bytes are given for logprobs.

``n`` choices run concurrently, each its own generation (and session on every hop); choice
``i`` of a seeded request is seeded ``(seed + i) mod 2**63`` (:func:`meshnet.protocol.openai.for_choice`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
import uuid
import weakref
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from meshnet.cpu import off_loop
from meshnet.drain import EventStream
from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.gateway.pipeline import GenerationStats, Orchestrator
from meshnet.gateway.tools import answer_deltas, calls_field, calls_finish, parse_answer, prompt_messages, tool_syntax
from meshnet.gateway.entry import TokenLogprob
from meshnet.protocol.http import error_response, sse_error
from meshnet.protocol.openai import ChatRequest, SamplingParams, for_choice, parse_chat_request, read_chat_request

__all__ = ["complete", "stream", "text_deltas", "read_chat", "error_response", "parse_chat_request"]

# per-tokenizer facts, computed once (weak keys: a dropped shard's tokenizer is not kept alive)
_BYTE_LEVEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TextDecoder:
    """The text of the ids added so far (``skip_special_tokens=True``), grown token by token.

    The window ``ids[prefix:]`` is decoded and compared with the decoding of
    ``ids[prefix:read]`` (text already emitted); the difference is new text. While the
    window ends inside a multi-byte character (decodes to a trailing U+FFFD) nothing is
    emitted, so characters split across tokens come out whole. The window's left edge stays
    one step behind, which keeps tokenizers that strip a leading space on the first token of
    a decode from losing it.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start (index into ids)
        self._read = 0    # ids before this index have their text in ``self.text``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; returns the whole text so far (complete characters only)."""
        self.ids.append(token_id)
        done = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(done) and not window.endswith("\ufffd"):
            self.text += window[len(done):]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text

    def flush(self) -> str:
        """The whole text, including a trailing incomplete character (as U+FFFD)."""
        done = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(done):
            self.text += window[len(done):]
        self._prefix = self._read = len(self.ids)
        return self.text


def _printable_bytes() -> dict[str, int]:
    """Byte-level BPE's alphabet: every byte value is written as one printable character
    (printable Latin-1 bytes as themselves, the other 68 as U+0100 onwards, in byte order).
    Returns character → byte."""
    same = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in same}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


_PRINTABLE = _printable_bytes()


def _is_byte_level(tokenizer) -> bool:
    cached = _BYTE_LEVEL.get(tokenizer)
    if cached is None:
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        cached = "ByteLevel" in type(getattr(backend, "decoder", None)).__name__
        _BYTE_LEVEL[tokenizer] = cached
    return cached


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token (special tokens included; a partial UTF-8 character is U+FFFD)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """The UTF-8 bytes one token stands for, as OpenAI's ``logprobs`` ``bytes`` (ints 0..255).

    Byte-level BPE tokens give their exact bytes, also when they hold only part of a
    character; other tokens (added and special tokens, other tokenizer kinds) the UTF-8 of
    their text.
    """
    if token_id not in getattr(tokenizer, "added_tokens_decoder", {}) and _is_byte_level(tokenizer):
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in _PRINTABLE for c in piece):
            return [_PRINTABLE[c] for c in piece]
    return list(token_text(tokenizer, token_id).encode("utf-8"))


def max_token_chars(tokenizer) -> int:
    """The most characters any single token can stand for (cached per tokenizer): the
    longest vocabulary entry. A text of ``c`` characters is at least ``ceil(c / this)``
    tokens, a bound that needs no tokenization."""
    if tokenizer not in _MAX_CHARS:
        _MAX_CHARS[tokenizer] = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    return _MAX_CHARS[tokenizer]


log = logging.getLogger(__name__)


def context_limit(orchestrator: Orchestrator) -> int:
    """The model's context in tokens (``max_position_embeddings``; 0 when unknown)."""
    return orchestrator.entry.context_tokens


def fit_context(orchestrator: Orchestrator, prompt: list[int], params: SamplingParams) -> SamplingParams:
    """Clip ``max_tokens`` to the model's context (``max_position_embeddings``).

    Raises:
        InvalidRequest: the prompt alone fills the context (400 ``context_length_exceeded``).
    """
    limit = context_limit(orchestrator)
    if not limit:
        return params
    if len(prompt) >= limit:
        raise InvalidRequest(f"prompt is {len(prompt)} tokens; the model's context is {limit} tokens",
                             code="context_length_exceeded", hint="shorten the messages", param="messages")
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, limit - len(prompt)))


def encode_prompt(orchestrator: Orchestrator, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` (and ``tools``, for a template that renders them) under the chat
    template. CPU-bound: call it in a worker thread.

    A prompt that cannot fit is refused before tokenizing it: no token stands for more than
    :func:`max_token_chars` characters, so ``chars / max_token_chars`` tokens is a lower bound.

    Raises:
        InvalidRequest: 400 ``context_length_exceeded`` (by the bound or the real count).
    """
    limit = context_limit(orchestrator)
    chars = sum(len(m.get("content") or "") for m in messages)
    if limit and chars:
        at_least = math.ceil(chars / max_token_chars(orchestrator.tokenizer))
        if at_least >= limit:
            raise InvalidRequest(f"prompt is at least {at_least} tokens ({chars} characters); the model's "
                                 f"context is {limit} tokens", code="context_length_exceeded",
                                 hint="shorten the messages", param="messages")
    return orchestrator.encode_chat(messages, tools)


async def prepare(orchestrator: Orchestrator, req: ChatRequest) -> tuple[list[int], SamplingParams]:
    """Prompt ids (tokenized in the request pool) and choice-0 settings fitted to the context.

    Raises:
        InvalidRequest: a ``logit_bias`` token id outside the vocabulary, or a prompt too long.
    """
    params = req.sampling()
    bad = [i for i, _ in params.logit_bias if i >= orchestrator.vocab_size]
    if bad:
        raise InvalidRequest(f"invalid field 'logit_bias': token id {bad[0]} is outside the vocabulary "
                             f"(0..{orchestrator.vocab_size - 1})", code="invalid_field", param="logit_bias")
    prompt = await off_loop(encode_prompt, orchestrator, *prompt_messages(req, tool_syntax(orchestrator.tokenizer)))
    return prompt, fit_context(orchestrator, prompt, params)


async def text_deltas(orchestrator: Orchestrator, prompt: list[int], params: SamplingParams,
                      stats: GenerationStats, disconnected=None) -> AsyncIterator[str]:
    """Yield text pieces as tokens arrive, honouring ``stop`` strings.

    Text grows through a :class:`TextDecoder`, so multi-byte characters split across tokens
    come out whole; a stop string ends the generation and is not emitted (the last
    ``max(len(stop))`` characters are held back until they cannot start one). Only the new
    text (plus that overlap) is searched for stop strings. ``disconnected`` (async, optional)
    is polled every token: a client that went away stops the generation, which frees its
    sessions on every hop. ``params`` are already fitted to the context by :func:`fit_context`.
    When the first piece is handed out, ``stats.first_token_s`` records the time since
    ``stats.arrived_s``: time to first token as the client sees it.
    """
    decoder = TextDecoder(orchestrator.tokenizer)

    def first(piece: str) -> str:
        if stats.first_token_s is None and stats.arrived_s:
            stats.first_token_s = time.perf_counter() - stats.arrived_s
            if orchestrator.observer is not None:
                orchestrator.observer.first_token(stats.first_token_s)
        return piece

    sent = 0
    hold = max((len(s) for s in params.stop), default=0)
    async with contextlib.aclosing(orchestrator.generate(prompt, params, stats)) as tokens:
        async for token in tokens:
            if disconnected is not None and await disconnected():
                stats.finish_reason = "cancelled"
                return
            searched = len(decoder.text)
            text = decoder.add(token)
            if len(text) == searched:
                continue
            cuts = [text.find(s, max(0, searched - len(s) + 1)) for s in params.stop]
            cuts = [c for c in cuts if c != -1]
            if cuts:
                stats.finish_reason = "stop"
                if min(cuts) > sent:
                    yield first(text[sent:min(cuts)])
                return
            if len(text) - hold > sent:
                yield first(text[sent:len(text) - hold])
                sent = len(text) - hold
    text = decoder.flush()
    if len(text) > sent:
        yield first(text[sent:])


#: choices of one request generating at once: each is a session on every hop of its route (its
#: own prefill and KV cache), and their decode steps batch together (ADR-0052); more would crowd
#: out other clients' sessions, so ``n`` up to 128 runs in waves
CHOICES_AT_ONCE = 8


async def choice_deltas(orchestrator: Orchestrator, prompt: list[int], params: list[SamplingParams],
                        stats: list[GenerationStats], disconnected=None,
                        ) -> AsyncIterator[tuple[int, str | None, int]]:
    """Run the choices concurrently, at most :data:`CHOICES_AT_ONCE` at a time (in index order);
    yield ``(index, piece, logprobs_so_far)`` as pieces come, and ``(index, None,
    len(stats[index].logprobs))`` when choice ``index`` has finished.

    ``logprobs_so_far`` is how many entries of ``stats[index].logprobs`` belong to the text
    yielded up to this piece. The first error of any choice is raised and stops the others.
    """
    queue: asyncio.Queue = asyncio.Queue(maxsize=64)
    slots = asyncio.Semaphore(CHOICES_AT_ONCE)

    async def run(i: int) -> None:
        try:
            async with slots:
                async for piece in text_deltas(orchestrator, prompt, params[i], stats[i], disconnected):
                    await queue.put((i, piece, len(stats[i].logprobs), None))
            await queue.put((i, None, len(stats[i].logprobs), None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, None, 0, exc))

    tasks = [asyncio.create_task(run(i)) for i in range(len(params))]
    try:
        running = len(tasks)
        while running:
            i, piece, count, exc = await queue.get()
            if exc is not None:
                raise exc
            running -= piece is None
            yield i, piece, count
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def logprob_entries(tokenizer, items: list[TokenLogprob]) -> list[dict]:
    """OpenAI's ``logprobs.content`` entries: ``{token, logprob, bytes, top_logprobs}``."""
    def one(token_id: int, logprob: float) -> dict:
        return {"token": token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": token_bytes(tokenizer, token_id)}
    return [{**one(x.token_id, x.logprob), "top_logprobs": [one(t, lp) for t, lp in x.top]} for x in items]


def meshnet_block(stats: list[GenerationStats]) -> dict:
    """The ``meshnet`` object of a response: route used, measured speeds and speculative decoding
    (decode traversals, drafts sent and kept, ADR-0058) of choice 0, and with ``n > 1`` the same for
    every choice under ``choices``."""
    def one(s: GenerationStats) -> dict:
        return {"route": [h.to_json() for h in s.route], "prefill_s": round(s.prefill_s, 4),
                "time_to_first_token_s": None if s.first_token_s is None else round(s.first_token_s, 4),
                "decode_tokens_per_s": round(s.decode_tokens_per_s, 3), "failovers": s.failovers,
                "deadline_misses": s.deadline_misses, "verified": s.verified, "completion_token_ids": s.token_ids,
                "speculation": {"traversals": s.traversals, "drafted": s.drafted, "accepted": s.accepted,
                                "tokens_per_traversal": round(s.tokens_per_traversal, 3)}}
    block = one(stats[0])
    if len(stats) > 1:
        block["choices"] = [one(s) for s in stats]
    return block


def usage(stats: list[GenerationStats]) -> dict:
    """Token counts: the prompt once, the completions of all choices summed (as OpenAI counts)."""
    prompt, completion = stats[0].prompt_tokens, sum(s.completion_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choices_for(params: SamplingParams, n: int, arrived_s: float) -> tuple[list[SamplingParams], list[GenerationStats]]:
    """Each of ``n`` choices' settings (:func:`for_choice`) and its fresh stats."""
    return [for_choice(params, i) for i in range(n)], [GenerationStats(arrived_s=arrived_s) for _ in range(n)]


async def complete(orchestrator: Orchestrator, model: str, req: ChatRequest,
                   disconnected=None) -> Response:
    """Non-streaming completion: ``n`` choices plus ``usage`` and the ``meshnet`` block."""
    arrived_s = time.perf_counter()
    prompt, params = await prepare(orchestrator, req)
    params_n, stats = choices_for(params, req.n, arrived_s)
    texts = [""] * req.n
    async for i, piece, _ in choice_deltas(orchestrator, prompt, params_n, stats, disconnected):
        texts[i] += piece or ""
    syntax = tool_syntax(orchestrator.tokenizer)
    answers = [parse_answer(text, req, syntax) for text in texts]

    def render() -> bytes:
        # up to n * max_tokens * (1 + top_logprobs) entries: built and serialised off the event loop
        choices = [{"index": i, "message": {"role": "assistant", "content": answers[i][0],
                                            **calls_field(answers[i][1], req)},
                    "logprobs": ({"content": logprob_entries(orchestrator.tokenizer, stats[i].logprobs),
                                  "refusal": None} if params.top_logprobs is not None else None),
                    "finish_reason": calls_finish(answers[i][1], req) or stats[i].finish_reason}
                   for i in range(req.n)]
        return json.dumps({
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(stats), "meshnet": meshnet_block(stats)},
            ensure_ascii=False, separators=(",", ":")).encode()

    return Response(await off_loop(render), media_type="application/json")


def _chunk(head: dict, want_logprobs: bool, include_usage: bool, index: int | None, delta: dict | None = None,
           finish: str | None = None, logprobs=None, **extra) -> str:
    """One ``chat.completion.chunk`` event (``head``: its id, object, created and model)."""
    choices = []
    if index is not None:
        choice = {"index": index, "delta": delta or {}, "finish_reason": finish}
        if want_logprobs:
            choice["logprobs"] = None if logprobs is None else {"content": logprobs, "refusal": None}
        choices.append(choice)
    body = {**head, "choices": choices, **({"usage": None} if include_usage else {}), **extra}
    return f"data: {json.dumps(body)}\n\n"


async def stream(orchestrator: Orchestrator, model: str, req: ChatRequest) -> EventStream:
    """Server-sent events in OpenAI's chunk shape, ending with ``data: [DONE]``.

    Each choice opens with a role chunk and ends with a chunk carrying its ``finish_reason``;
    the last of those also carries meshnet's ``meshnet`` block. Usage is sent only when asked, as
    in OpenAI's API: with ``stream_options.include_usage`` every chunk has ``"usage": null`` but a
    final one with no choices, which carries the whole request's ``usage`` (summing the chunks'
    usage counts it once). An answer that may call tools is sent once whole: its content, then its
    ``tool_calls`` (:mod:`meshnet.gateway.tools`). An error after the first event is sent as an
    ``{"error": ...}`` event.
    """
    cid, created, arrived_s = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), time.perf_counter()
    prompt, params = await prepare(orchestrator, req)  # a bad or too-long prompt is a 400 before any event
    params_n, stats = choices_for(params, req.n, arrived_s)
    want_logprobs = params.top_logprobs is not None
    include_usage = req.stream_options is not None and req.stream_options.include_usage

    chunk = functools.partial(_chunk, {"id": cid, "object": "chat.completion.chunk", "created": created,
                                       "model": model}, want_logprobs, include_usage)
    tooled = tool_syntax(orchestrator.tokenizer) if req.calling_tools() else None  # held whole, then parsed
    held = [""] * req.n

    async def events() -> AsyncIterator[str | bytes]:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        sent, finished = [0] * req.n, 0
        try:
            async for i, piece, count in choice_deltas(orchestrator, prompt, params_n, stats):
                entries = None
                if want_logprobs:
                    entries = logprob_entries(orchestrator.tokenizer, stats[i].logprobs[sent[i]:count])
                    sent[i] = count
                if piece is not None and tooled:
                    held[i] += piece
                    continue
                if piece is not None:
                    yield chunk(i, {"content": piece}, logprobs=entries)
                    continue
                deltas, finish = answer_deltas(held[i], req, tooled) if tooled else ([], None)
                finish = finish or stats[i].finish_reason
                for delta in deltas:
                    yield chunk(i, delta)
                finished += 1
                extra = {"meshnet": meshnet_block(stats)} if finished == req.n else {}
                yield chunk(i, {}, finish, logprobs=entries or None, **extra)
        except MeshnetError as exc:
            yield sse_error(exc)
            return
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, never drop it
            log.exception("generation failed mid-stream")
            err = MeshnetError(f"generation failed: {type(exc).__name__}: {exc}")
            yield sse_error(err)
            return
        if include_usage:
            yield chunk(None, usage=usage(stats))
        yield "data: [DONE]\n\n"

    return EventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def read_chat(request: Request) -> ChatRequest:
    """The request's chat body, validated (parsed off the event loop when big)."""
    return await read_chat_request(await request.body())
