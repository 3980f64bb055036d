"""The Responses API as the chat call the fleet runs, and back: pure functions, no Redis.

The line, the workers and the engines know one API, chat completions. A Responses request is
mapped here, one way, to the chat body its call carries (`chat_body`), and the chat answer back
to the Response's output items (`output_items`) and object (`response_object`):

    instructions                   -> a system message first (never stored: OpenAI does not carry
                                      them over to a continuation)
    input string / message items   -> user / system / developer / assistant messages
                                      (input_text, output_text -> text parts; input_image -> image_url)
    function_call items            -> the assistant turn's tool_calls (consecutive calls, one turn)
    function_call_output items     -> tool messages
    reasoning items                -> kept in the conversation, not sent (the engine re-reasons)
    tools, tool_choice             -> chat's function tools and tool_choice
    text.format                    -> response_format (json_schema, json_object)
    max_output_tokens, reasoning   -> max_tokens, reasoning_effort
    ignore_eos (vLLM's extension)  -> ignore_eos

    message.content / refusal      -> a `message` item with `output_text` / `refusal` parts
    message.tool_calls             -> `function_call` items (the engine's id is the `call_id`)
    reasoning_content / reasoning  -> a `reasoning` item
    finish_reason length           -> status `incomplete` (max_output_tokens)
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from fleet.store.events import Done
from gateway.responses_schema import NamedFunction, ResponsesBody

REASONING_KEYS = ("reasoning_content", "reasoning")  # what engines call a chat answer's reasoning


def new_id(prefix: str) -> str:
    """An unguessable id: 192 random bits (a response's id is what lets its conversation be read)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def json_size(obj: Any) -> int:
    """What `obj` stores as, in bytes (the store's bounds are in these)."""
    return len(orjson.dumps(obj))


# --- the request ------------------------------------------------------------------------------

def input_items(body: ResponsesBody) -> list[dict[str, Any]]:
    """The turn's new input as items, as they are stored (a string is one user message)."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [item.model_dump(exclude_none=True, by_alias=True) for item in body.input]


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items (see the module doc)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": _content(item["content"], item["role"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                last["tool_calls"] = [call]  # the text the model said before calling
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text_of(output)})
    return out


def _content(content: str | list[dict[str, Any]], role: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if role == "assistant" or all(p["type"] != "input_image" for p in content):
        return _text_of(content)  # an assistant turn's parts, or text only: chat's plain string
    return [{"type": "image_url", "image_url": {"url": p.get("image_url") or "", **(
        {"detail": p["detail"]} if p.get("detail") else {})}} if p["type"] == "input_image"
            else {"type": "text", "text": p.get("text") or p.get("refusal") or ""} for p in content]


def _text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in parts)


def chat_body(body: ResponsesBody, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request a Responses request runs as, over `conversation` (the stored
    history and this turn's input items)."""
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages(body.instructions, conversation),
                            "stream": body.stream}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.json_schema or {}}
        schema.update({k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None})
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    for ours, theirs in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                         ("top_p", body.top_p), ("user", body.user)):
        if theirs is not None:
            chat[ours] = theirs
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if body.ignore_eos:
        chat["ignore_eos"] = True
    return chat


# --- the answer -------------------------------------------------------------------------------

def message_item(text: str, refusal: str | None = None, *, item_id: str | None = None,
                 status: str = "completed") -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if text or not refusal:
        parts.append({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    if refusal:
        parts.append({"type": "refusal", "refusal": refusal})
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": parts}


def function_call_item(call_id: str | None, name: str, arguments: str, *, item_id: str | None = None,
                       status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id or new_id("call"),
            "name": name, "arguments": arguments, "status": status}


def reasoning_item(text: str, *, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as Response output items: reasoning, text, then function calls."""
    out: list[dict[str, Any]] = []
    reasoning = next((message[k] for k in REASONING_KEYS if message.get(k)), None)
    if reasoning:
        out.append(reasoning_item(str(reasoning)))
    text, refusal = message.get("content") or "", message.get("refusal")
    calls = message.get("tool_calls") or []
    if text or refusal or not calls:
        out.append(message_item(text if isinstance(text, str) else _text_of(text), refusal))
    for c in calls:
        fn = c.get("function") or {}
        out.append(function_call_item(c.get("id"), fn.get("name") or "", fn.get("arguments") or ""))
    return out


def usage_of(done: Done | None) -> dict[str, Any] | None:
    """The Response's usage: input, output and total tokens (with the details clients read)."""
    if done is None:
        return None
    details = done.usage.get("prompt_tokens_details") or {}
    out_details = done.usage.get("completion_tokens_details") or {}
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": int(details.get("cached_tokens") or 0)},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": int(out_details.get("reasoning_tokens") or 0)},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def status_of(finish_reason: str) -> tuple[str, dict[str, Any] | None]:
    """A finish reason as the Response's status and incomplete_details."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def response_object(response_id: str, body: ResponsesBody, created_at: float, *, status: str = "in_progress",
                    output: list[dict[str, Any]] | None = None, done: Done | None = None,
                    error: dict[str, Any] | None = None, stored: bool | None = None) -> dict[str, Any]:
    """The Response object at one stage of its life (created, completed, failed)."""
    incomplete = None
    if done is not None:
        status, incomplete = status_of(done.finish_reason)
    fmt = body.text.format.model_dump(exclude_none=True, by_alias=True) if body.text and body.text.format else \
        {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": int(created_at), "status": status,
        "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": (done.model if done and done.model else body.model),
        "output": output or [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": body.reasoning.summary if body.reasoning else None},
        "store": body.store if stored is None else stored, "temperature": body.temperature,
        "text": {"format": fmt}, "tool_choice": _tool_choice(body),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()], "top_p": body.top_p,
        "truncation": "disabled", "usage": usage_of(done), "user": body.user, "metadata": body.metadata or {},
        "completed_at": int(time.time()) if status == "completed" else None,
    }


def _tool_choice(body: ResponsesBody) -> Any:
    if isinstance(body.tool_choice, NamedFunction):
        return body.tool_choice.model_dump()
    return body.tool_choice or "auto"
