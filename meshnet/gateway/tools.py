"""Tool calls: the tools in the prompt, the model's calls out of its answer (OpenAI's ``tools``).

A model family writes calls in its own syntax, and its chat template (when it knows tools)
renders the tools, earlier calls and their results in it. :func:`tool_syntax` reads which one a
tokenizer's template uses:

- ``hermes`` (Qwen 2/2.5/3, Hermes and many fine-tunes): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` per call;
- ``llama3`` (Llama 3.1+): the answer is ``{"name": ..., "parameters": {...}}``, several joined by
  ``;``, after an optional ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or (newer
  templates) ``[TOOL_CALLS]name[ARGS]{...}`` per call;
- ``prompt``: the template knows no tools (SmolLM2, the tiny test models): one documented system
  message lists them (:data:`TOOLS_PROMPT`) and asks for the Hermes syntax; earlier calls are
  rendered in it and ``tool`` messages as ``<tool_response>`` turns of the user.

With ``tool_choice`` ``required`` or a named function the answer decodes under the call's JSON
Schema (ADR-0053), whatever the syntax, so even a small model returns a valid call; with ``auto``
the answer is free and its calls are parsed in the family's syntax. The legacy ``functions`` /
``function_call`` are the same calls in another shape (:class:`meshnet.protocol.openai.ChatRequest`).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass

from meshnet.protocol.openai import ChatRequest
from meshnet.protocol.structured import Tool

TOOLS_PROMPT = ("You may call functions to answer. They are described, one JSON Schema per line, inside "
                "<tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call a function, answer with "
                "<tool_call>{{\"name\": <function name>, \"arguments\": <arguments object>}}</tool_call> "
                "for each call.")

_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_-]{1,64})\[ARGS\]")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolSyntax:
    """How a model family writes tool calls (see the module). ``native``: its chat template
    renders tools itself (``apply_chat_template(tools=...)``); ``id_chars``: the length of call ids
    its template accepts (Mistral's checks for 9 letters and digits; 0: any)."""

    name: str
    native: bool
    id_chars: int = 0


HERMES = ToolSyntax("hermes", native=True)
LLAMA3 = ToolSyntax("llama3", native=True)
MISTRAL = ToolSyntax("mistral", native=True, id_chars=9)
PROMPT = ToolSyntax("prompt", native=False)


def tool_syntax(tokenizer) -> ToolSyntax:
    """The tool syntax of ``tokenizer``'s chat template: read from the markers it renders
    (``[TOOL_CALLS]``, ``<tool_call>``, ``<|python_tag|>`` or Llama's ``ipython`` role), else
    :data:`PROMPT` (a template that never mentions ``tools`` cannot render them)."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    if "tools" not in template:
        return PROMPT
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return PROMPT


def _arguments(arguments: str | dict) -> dict:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def _call_text(name: str, arguments: str | dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': _arguments(arguments)}, ensure_ascii=False)}</tool_call>"


def _native_message(m) -> dict:
    """A message as templates that know tools take it: ``tool_calls`` with arguments as objects."""
    entry = m.model_dump(exclude_none=True, include={"role", "content", "name", "tool_call_id"})
    if m.tool_calls:
        entry["content"] = m.content or ""
        entry["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
    return entry


def prompt_messages(req: ChatRequest, syntax: ToolSyntax = PROMPT) -> tuple[list[dict], list[dict] | None]:
    """The request's messages as the template renders them, and the tools for a template that
    renders them itself (None otherwise). With :data:`PROMPT`: role and text (and ``name``), the
    tools' system prompt first when the model may call any, earlier calls and tool answers as text.

    Raises:
        ValueError: an earlier call's ``arguments`` are not JSON (the parser names the message).
    """
    tools = req.calling_tools()
    if syntax.native:
        return [_native_message(m) for m in req.messages], \
            [t.model_dump(exclude_none=True) for t in tools] or None
    out = []
    for m in req.messages:
        entry = m.model_dump(exclude_none=True, include={"role", "content", "name"})
        if m.tool_calls:
            calls = "\n".join(_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            entry["content"] = f"{m.content}\n{calls}" if m.content else calls
        if m.role == "tool":
            entry = {"role": "user", "content": f"<tool_response>\n{m.content or ''}\n</tool_response>"}
        out.append(entry)
    if tools:
        listing = "\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
        system = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _call_id(syntax: ToolSyntax) -> str:
    if syntax.id_chars:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(syntax.id_chars))
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments, syntax: ToolSyntax) -> dict:
    return {"id": _call_id(syntax), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _named(value, tools: list[Tool], args_key: str = "arguments") -> tuple[str, dict] | None:
    """``(name, arguments)`` when ``value`` is a call of one of ``tools``."""
    if not isinstance(value, dict) or value.get("name") not in {t.function.name for t in tools}:
        return None
    arguments = value.get(args_key, value.get("arguments"))
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def _json_at(text: str, at: int):
    """The JSON value starting at ``text[at:]`` (after spaces) and where it ends, or (None, at)."""
    while at < len(text) and text[at].isspace():
        at += 1
    try:
        return _DECODER.raw_decode(text, at)
    except ValueError:
        return None, at


def _hermes_calls(text: str, tools: list[Tool]) -> tuple[list[tuple[str, dict]], str]:
    calls, kept = [], text
    for match in _HERMES_CALL.finditer(text):
        try:
            call = _named(json.loads(match.group(1)), tools)
        except ValueError:
            continue
        if call:
            calls.append(call)
            kept = kept.replace(match.group(0), "", 1)
    return calls, kept


def _llama3_calls(text: str, tools: list[Tool]) -> tuple[list[tuple[str, dict]], str]:
    body = text.strip().removeprefix("<|python_tag|>")
    calls, at = [], 0
    while at < len(body):
        value, end = _json_at(body, at)
        call = _named(value, tools, "parameters")
        if call is None:
            break
        calls.append(call)
        at = end
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    if not calls or body[at:].strip():  # the answer is calls and nothing else, or it is text
        return [], text
    return calls, ""


def _mistral_calls(text: str, tools: list[Tool]) -> tuple[list[tuple[str, dict]], str]:
    head, marker, rest = text.partition("[TOOL_CALLS]")
    if not marker:
        return [], text
    value, _ = _json_at(rest, 0)
    if isinstance(value, list):
        calls = [c for c in (_named(v, tools) for v in value) if c]
        return (calls, head) if calls else ([], text)
    calls = []
    for part in rest.split("[TOOL_CALLS]"):
        named = _MISTRAL_NAMED.match(part)
        if not named:
            continue
        arguments, _ = _json_at(part, named.end())
        call = _named({"name": named.group(1), "arguments": arguments}, tools)
        if call:
            calls.append(call)
    return (calls, head) if calls else ([], text)


_PARSERS = {"hermes": _hermes_calls, "prompt": _hermes_calls, "llama3": _llama3_calls, "mistral": _mistral_calls}


def parse_answer(text: str, req: ChatRequest, syntax: ToolSyntax = PROMPT) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of an answer: with a forced call the whole text is the call's JSON
    (text that is not one, cut by ``max_tokens``, stays content); otherwise each call written in
    ``syntax`` naming a known tool becomes a call and the rest is the content (None when empty).
    With ``parallel_tool_calls: false`` only the first call is kept."""
    tools = req.calling_tools()
    if not tools:
        return text, []
    if req.forced_tools():
        try:
            call = _named(json.loads(text), tools)
        except ValueError:
            call = None
        return (None, [_call(*call, syntax)]) if call else (text, [])
    found, kept = _PARSERS[syntax.name](text, tools)
    calls = [_call(name, arguments, syntax) for name, arguments in found]
    if req.parallel_tool_calls is False:
        calls = calls[:1]
    content = kept.strip() if calls else text
    return (content or None), calls


def answer_deltas(text: str, req: ChatRequest, syntax) -> tuple[list[dict], str | None]:
    """The deltas of a held answer that may hold tool calls (its content, then its ``tool_calls``
    in OpenAI's streamed shape) and the finish reason they imply (None: the generation's own)."""
    content, calls = parse_answer(text, req, syntax)
    deltas = [{"content": content}] if content else []
    if calls and req.legacy_functions:
        deltas.append(calls_field(calls, req))
    elif calls:
        deltas.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
    return deltas, calls_finish(calls, req)


def calls_field(calls: list[dict], req: ChatRequest) -> dict:
    """An answer's calls as its message carries them: ``tool_calls``, or with the legacy
    ``functions`` one ``function_call`` (name and arguments); nothing without calls."""
    if not calls:
        return {}
    return {"function_call": calls[0]["function"]} if req.legacy_functions else {"tool_calls": calls}


def calls_finish(calls: list[dict], req: ChatRequest) -> str | None:
    """The finish reason calls give an answer (None without calls: the generation's own)."""
    if not calls:
        return None
    return "function_call" if req.legacy_functions else "tool_calls"
