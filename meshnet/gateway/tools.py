"""Tool calls: the tools in the prompt, the model's calls out of its answer (OpenAI's ``tools``).

The tools reach the model through one documented prompt, whatever the chat template (a system
message listing each function's JSON Schema and asking for ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` per call, the Hermes convention that Qwen and many fine-tunes follow). A
conversation's earlier calls are rendered the same way, and ``tool`` messages as
``<tool_response>`` turns of the user. With ``tool_choice`` ``required`` or a named function the
answer decodes under the call's JSON Schema (ADR-0053), so even a small model returns a valid
call; with ``auto`` the answer is free and its ``<tool_call>`` blocks are parsed. Templates' own
tool syntaxes (Llama 3's, Mistral's ``[TOOL_CALLS]``) are not used yet.
"""

from __future__ import annotations

import json
import re
import uuid

from meshnet.protocol.openai import ChatRequest, Tool

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

TOOLS_PROMPT = ("You may call functions to answer. They are described, one JSON Schema per line, inside "
                "<tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call a function, answer with "
                "<tool_call>{{\"name\": <function name>, \"arguments\": <arguments object>}}</tool_call> "
                "for each call.")


def _call_text(name: str, arguments: str | dict) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}</tool_call>"


def prompt_messages(req: ChatRequest) -> list[dict]:
    """The request's messages as the template renders them: role and text (and ``name``), the
    tools' system prompt first when the model may call any, earlier calls and tool answers as text.

    Raises:
        ValueError: an earlier call's ``arguments`` are not JSON (the parser names the message).
    """
    out = []
    for m in req.messages:
        entry = m.model_dump(exclude_none=True, include={"role", "content", "name"})
        if m.tool_calls:
            calls = "\n".join(_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            entry["content"] = f"{m.content}\n{calls}" if m.content else calls
        if m.role == "tool":
            entry = {"role": "user", "content": f"<tool_response>\n{m.content or ''}\n</tool_response>"}
        out.append(entry)
    tools = req.calling_tools()
    if tools:
        listing = "\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
        system = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call(name: str, arguments) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _valid(value, tools: list[Tool]) -> bool:
    return (isinstance(value, dict) and value.get("name") in {t.function.name for t in tools}
            and isinstance(value.get("arguments"), dict))


def parse_answer(text: str, req: ChatRequest) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of an answer: with a forced call the whole text is the call's JSON
    (text that is not one, cut by ``max_tokens``, stays content); otherwise each ``<tool_call>``
    block naming a known tool becomes a call and the rest is the content (None when empty). With
    ``parallel_tool_calls: false`` only the first call is kept."""
    tools = req.calling_tools()
    if not tools:
        return text, []
    if req.forced_tools():
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        return (None, [_call(value["name"], value["arguments"])]) if _valid(value, tools) else (text, [])
    calls, kept = [], text
    for match in _CALL.finditer(text):
        try:
            value = json.loads(match.group(1))
        except ValueError:
            continue
        if _valid(value, tools):
            calls.append(_call(value["name"], value["arguments"]))
            kept = kept.replace(match.group(0), "", 1)
    if req.parallel_tool_calls is False:
        calls = calls[:1]
    content = kept.strip() if calls else text
    return (content or None), calls
