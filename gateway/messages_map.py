"""Anthropic's Messages API as the chat call the fleet runs, and back: pure functions, no Redis.

The line, the workers and the engines know one API, chat completions (as the Responses API,
`gateway.responses_map`). A Messages request maps to the chat body its call carries:

    system (a string or text blocks)   -> a system message first
    messages[].role "system"           -> a system message where it stands (Claude Code sends them)
    text / image blocks                -> text / image_url parts (text only: one string)
    tool_use blocks (assistant)        -> the turn's tool_calls (input as JSON arguments)
    tool_result blocks (user)          -> tool messages, before the rest of the turn
    thinking, redacted_thinking blocks -> left out (the engine reasons again)
    tools {name, description, input_schema} -> function tools; tool_choice auto/any/tool/none
    max_tokens, stop_sequences, temperature, top_p -> max_tokens, stop, temperature, top_p
    top_k, thinking                    -> top_k, chat_template_kwargs.enable_thinking (vLLM only)
    ignore_eos (vLLM's extension)      -> ignore_eos
    metadata.user_id                   -> user (a digest when over chat's 256 characters)
    cache_control, output_config, context_management, service_tier, ... -> ignored, never refused

and the chat answer back to a message (`message_object`): reasoning -> a `thinking` block, text
-> a `text` block, tool calls -> `tool_use` blocks; finish reasons -> `stop_reason`. Errors take
Anthropic's shape (`error_body`), with the fleet's own fields beside the type and message.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_config import EngineName
from fleet.store.events import Done
from gateway.errors import APIError
from gateway.schemas import MAX_MESSAGES, MAX_MODEL_NAME, MAX_TOOLS, MAX_USER_CHARS, StopList

REASONING_KEYS = ("reasoning_content", "reasoning")  # what engines call a chat answer's reasoning
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}


TEXT_BLOCKS = {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}


class CountBody(BaseModel):
    """`POST /v1/messages/count_tokens`: what the fleet reads of a Messages body (anything else
    is allowed and ignored: Claude Code sends fields this gateway has no use for)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME)
    # The turns are read by `_turn` (errors naming the block); the published schema says their shape
    # so schema-driven clients and fuzzers make real conversations.
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES, json_schema_extra={
        "minItems": 1, "items": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": ["user", "assistant"]}, "content": {"anyOf": [{"type": "string"}, TEXT_BLOCKS]}}}})
    system: str | list[dict[str, Any]] | None = Field(None, json_schema_extra={
        "anyOf": [{"type": "string"}, TEXT_BLOCKS, {"type": "null"}]})
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesBody(CountBody):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: StopList | None = None  # chat's bounds, named as the caller named them
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extension (benchmarks and tests need exact lengths), as on chat


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def bad(param: str, why: str) -> APIError:
    """A 400 naming the field or block (Anthropic's invalid_request_error)."""
    return APIError(400, f"{param}: {why}", param=param, code="invalid_value")


# --- the request ------------------------------------------------------------------------------

def _text_blocks(blocks: list[Any], where: str) -> str:
    """Text blocks as one string (cache_control and citations dropped); any other block is a 400."""
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{where}[{i}]", "only text blocks are accepted here")
        out.append(b["text"])
    return "\n".join(out)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    src = block.get("source")
    if not isinstance(src, dict):
        raise bad(f"{where}.source", "an image needs a source")
    if src.get("type") == "base64":
        url = f"data:{src.get('media_type') or 'image/png'};base64,{src.get('data') or ''}"
    elif src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise bad(f"{where}.source.type", "an image source is base64 or url")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat's content: one string when it is all text (as vLLM joins text parts), else parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tool_result(block: dict[str, Any], where: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A tool_result block as a tool message, and the images it returned (sent after it in a user turn)."""
    content = block.get("content")
    images: list[dict[str, Any]] = []
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        texts = []
        for j, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") == "image":
                images.append(_image(b, f"{where}.content[{j}]"))
            elif isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            else:
                raise bad(f"{where}.content[{j}]", "a tool result holds text and image blocks")
        text = "\n".join(texts)
    else:
        raise bad(f"{where}.content", "a tool result's content is a string or blocks")
    if not isinstance(block.get("tool_use_id"), str):
        raise bad(f"{where}.tool_use_id", "required")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}, images


def _turn(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages turn as chat messages (a user turn with tool results is several)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(where, "a message is an object with role and content")
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant", "system"):
        raise bad(f"{where}.role", "user, assistant or system")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content", "a string or a list of blocks")
    if role == "system":
        return [{"role": "system", "content": _text_blocks(content, f"{where}.content")}]
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        _block(b, role, f"{where}.content[{j}]", tools, parts, calls)
    if role == "assistant":
        text = "".join(p.get("text", "") for p in parts)
        msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    if parts or not tools:
        tools.append({"role": "user", "content": _user_content(parts)})
    return tools


def _block(b: Any, role: str, at: str, tools: list[dict[str, Any]], parts: list[dict[str, Any]],
           calls: list[dict[str, Any]]) -> None:
    """One block of a turn, into its tool messages, its content parts or its tool calls."""
    kind = b.get("type") if isinstance(b, dict) else None
    if kind == "text" and isinstance(b.get("text"), str):
        parts.append({"type": "text", "text": b["text"]})
    elif kind == "image":
        parts.append(_image(b, at))
    elif kind in ("thinking", "redacted_thinking"):
        return  # the engine reasons again; its own reasoning is not a prompt
    elif kind == "tool_use" and role == "assistant":
        if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
            raise bad(at, "a tool_use block needs an id and a name")
        calls.append({"id": b["id"], "type": "function", "function": {
            "name": b["name"], "arguments": orjson.dumps(b.get("input") or {}).decode()}})
    elif kind == "tool_result" and role == "user":
        tool, images = _tool_result(b, at)
        tools.append(tool)
        parts.extend(images)
    else:
        raise bad(f"{at}.type", f"a {kind!r} block is not served in a {role} turn")


def _tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise bad(f"tools[{i}]", "a tool needs a name")
    if not isinstance(t.get("input_schema"), dict):  # Anthropic's server tools (web_search, bash_...)
        raise bad(f"tools[{i}].input_schema", f"tool {t['name'][:64]!r}: only custom tools with an "
                  "input_schema are served")
    fn: dict[str, Any] = {"name": t["name"], "parameters": t["input_schema"]}
    if isinstance(t.get("description"), str):
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad("tool_choice.type", "auto, any, tool (with a name) or none")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def chat_messages(body: CountBody) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(body.system, str) and body.system:
        out.append({"role": "system", "content": body.system})
    elif isinstance(body.system, list) and body.system:
        out.append({"role": "system", "content": _text_blocks(body.system, "system")})
    for i, m in enumerate(body.messages):
        out.extend(_turn(m, i))
    return out


def chat_body(body: CountBody, engine: str = EngineName.SIM, max_tokens: int | None = None) -> dict[str, Any]:
    """The chat completion request a Messages request runs as (see the module doc). `engine` is
    the tier's: top_k and thinking go only where the engine takes them. `max_tokens` is the bound
    the call runs with (the caller's, cut to the tier's limit by the route)."""
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if body.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        _tool_choice(body.tool_choice, chat)
    if not isinstance(body, MessagesBody):
        return chat
    chat["stream"] = body.stream
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    chat["max_tokens"] = max_tokens or body.max_tokens
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    _sampling(body, engine, chat)
    user = (body.metadata or {}).get("user_id")
    if isinstance(user, str) and user:  # Claude Code's is a JSON string, often past chat's bound
        chat["user"] = user if len(user) <= MAX_USER_CHARS else "sha256:" + hashlib.sha256(user.encode()).hexdigest()
    return chat


def _sampling(body: MessagesBody, engine: str, chat: dict[str, Any]) -> None:
    for key in ("temperature", "top_p"):
        if getattr(body, key) is not None:
            chat[key] = getattr(body, key)
    if body.ignore_eos:
        chat["ignore_eos"] = True
    if engine == EngineName.VLLM:  # vLLM's sampling and chat template take these; OpenAI's API does not
        if body.top_k is not None and body.top_k > 0:
            chat["top_k"] = body.top_k
        if isinstance(body.thinking, dict) and body.thinking.get("type") in ("enabled", "adaptive", "disabled"):
            chat["chat_template_kwargs"] = {"enable_thinking": body.thinking["type"] != "disabled"}


# --- the answer -------------------------------------------------------------------------------

def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as tool_use input (an object; arguments that are not one: empty)."""
    try:
        got = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return got if isinstance(got, dict) else {}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as content blocks: thinking, text, then tool_use."""
    out: list[dict[str, Any]] = []
    reasoning = next((message[k] for k in REASONING_KEYS if message.get(k)), None)
    if reasoning:
        out.append({"type": "thinking", "thinking": str(reasoning), "signature": ""})
    text = message.get("content") or ""
    if isinstance(text, list):
        text = "".join(p.get("text") or "" for p in text if isinstance(p, dict))
    if text:
        out.append({"type": "text", "text": text})
    for c in message.get("tool_calls") or ():
        fn = c.get("function") or {}
        out.append({"type": "tool_use", "id": c.get("id") or new_id("toolu"), "name": fn.get("name") or "",
                    "input": tool_input(fn.get("arguments") or "")})
    return out


def stop_of(done: Done, stop_sequences: list[str] | None, tool_used: bool = False) -> tuple[str, str | None]:
    """The stop_reason and stop_sequence of a chat finish (vLLM names the stop string it met).

    Anthropic says `tool_use` whenever the answer called a tool; chat says `stop` for a call the caller
    named (`tool_choice` of one tool), so an answer with a tool_use block that stopped is `tool_use`, as
    vLLM's own Anthropic layer has it. A cut-off answer is still `max_tokens`: its call may be partial."""
    if tool_used and done.finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    matched = (done.choice or {}).get("stop_reason") or (done.extra or {}).get("stop_reason")
    if done.finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return STOP_REASONS.get(done.finish_reason, "end_turn"), None


def usage_of(done: Done) -> dict[str, Any]:
    """Anthropic's usage: input tokens not read from the cache, the cached ones, and the output."""
    cached = int((done.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": max(0, done.prompt_tokens - cached), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": done.completion_tokens}


def message_object(msg_id: str, model: str, content: list[dict[str, Any]], done: Done | None,
                   stop_sequences: list[str] | None = None, input_tokens: int = 0) -> dict[str, Any]:
    """The message: whole (with its `done`), or as message_start shows it (no stop yet)."""
    tool_used = any(block.get("type") == "tool_use" for block in content)
    stop, seq = stop_of(done, stop_sequences, tool_used) if done is not None else (None, None)
    usage = usage_of(done) if done is not None else {
        "input_tokens": input_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
        "output_tokens": 0}
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": seq, "usage": usage}


# --- errors -----------------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               504: "timeout_error", 529: "overloaded_error"}


def error_status(err: APIError) -> int:
    """The status in Anthropic's terms: a field out of bounds is a 400, an unavailable fleet 529."""
    return {422: 400, 503: 529}.get(err.status, err.status)


def error_body(err: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, with the fleet's code, param and
    refusal fields (tier, priority, retry_after_s) beside them."""
    status = error_status(err)
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    inner: dict[str, Any] = {"type": kind, "message": err.message, "code": err.code or err.type}
    if err.param is not None:
        inner["param"] = err.param
    inner.update(err.extra)
    return {"type": "error", "error": inner}
