"""`POST /v1/responses` bodies: OpenAI's Responses API, validated strictly where the fleet maps them.

Unlike a chat body, which reaches the engine as it arrived, a Responses body is mapped to the
chat call the fleet runs (`gateway.responses_map`), so every field must be one the map knows.
A field OpenAI defines that the fleet does not serve (`background: true`, hosted tools,
`conversation`, `prompt`, ...) is a typed 400 `unsupported_parameter` naming it
(`unsupported_fields`), never silently dropped; the fields clients send by habit with their
neutral value (`include: []`, `truncation: "disabled"`, `service_tier`, `prompt_cache_key`,
...) are accepted and have no effect. Strict as the chat body is: a number sent as a string is
a typed 422 naming the field. These models are also what `/openapi.json` publishes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gateway.errors import APIError
from gateway.schemas import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_MODEL_NAME,
    MAX_TOOLS,
    MAX_USER_CHARS,
    MetaKey,
    MetaValue,
    Name,
)

# OpenAI's ids are a prefix and 48 hex digits; a caller's is read only to look it up.
RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{48}$"
MAX_ID_CHARS = 256
Id = Annotated[str, StringConstraints(max_length=MAX_ID_CHARS)]

_STRICT = ConfigDict(strict=True, extra="allow")  # extras of items (ids, status, annotations) are kept as sent


class Part(BaseModel):
    """A content part: `input_text`, `output_text` or `refusal` (text), `input_image` (a URL)."""

    model_config = _STRICT

    type: Literal["input_text", "output_text", "refusal", "input_image"]
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    detail: str | None = None


class MessageItem(BaseModel):
    """A message: `{"role", "content"}` (the easy form, no `type`) or `{"type": "message", ...}`."""

    model_config = _STRICT

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS)]


class FunctionCallItem(BaseModel):
    """A function call the model made, sent back with the next turn."""

    model_config = _STRICT

    type: Literal["function_call"]
    call_id: Id
    name: Name
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """A tool's result, for the call of the same `call_id`."""

    model_config = _STRICT

    type: Literal["function_call_output"]
    call_id: Id
    output: str | Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS)]


class ReasoningItem(BaseModel):
    """A reasoning item from an earlier turn: kept in the conversation, not sent to the engine."""

    model_config = _STRICT

    type: Literal["reasoning"]


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class FunctionTool(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    name: Name


class TextFormat(BaseModel):
    """`text`, `json_object`, or `json_schema` with its `name`, `schema` and `strict`."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, StringConstraints(max_length=64)] | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(BaseModel):
    model_config = _STRICT

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesBody(BaseModel):
    """POST /v1/responses."""

    model_config = _STRICT

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME, description="A tier or one of its aliases.")
    input: str | Annotated[list[Item], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=MAX_ID_CHARS,
                                             description="Continue from a stored response (any gateway).")
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="At most the tier's max_tokens_limit.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    reasoning: Reasoning | None = None
    metadata: dict[MetaKey, MetaValue] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    stream: bool = False
    store: bool = Field(True, description="Keep the response and its conversation (GET, previous_response_id).")
    # vLLM's extension, as on chat: keep generating past EOS (benchmarks and tests need exact lengths).
    ignore_eos: bool = False


# Fields clients send by habit; accepted with these values (None: any value), with no effect.
NEUTRAL: dict[str, tuple[Any, ...] | None] = {
    "include": ([],), "truncation": ("disabled",), "background": (False,), "service_tier": None,
    "prompt_cache_key": None, "prompt_cache_retention": None, "safety_identifier": None, "stream_options": None,
    "top_logprobs": (0,), "max_tool_calls": None, "conversation": (),
}


def unsupported_fields(data: Any) -> None:
    """A typed 400 `unsupported_parameter` naming the first field the fleet does not serve: an
    unknown top-level field, a neutral one with another value, a tool or input item of a type
    the map does not know. Runs before validation, so the caller hears "unsupported", not
    "wrong type", for a hosted tool or an `item_reference`."""
    if not isinstance(data, dict):
        return  # validation says what is wrong with it
    known = ResponsesBody.model_fields
    for key, value in data.items():
        if key in known or value is None:
            continue
        allowed = NEUTRAL.get(key, ())
        if key not in NEUTRAL:
            raise _unsupported(key, f"{key[:64]} is not supported by this gateway")
        if allowed is not None and value not in allowed:
            raise _unsupported(key, f"{key} {str(value)[:64]!r} is not supported by this gateway")
    for i, tool in enumerate(data.get("tools") or () if isinstance(data.get("tools"), list) else ()):
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise _unsupported(f"tools.{i}.type", f"tools.{i}: only function tools are served, not "
                               f"{str(tool.get('type'))[:64]!r}")
    items = data.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if isinstance(item, dict) and "type" in item and item["type"] not in ITEM_TYPES:
            raise _unsupported(f"input.{i}.type", f"input.{i}: items of type {str(item['type'])[:64]!r} are not "
                               f"supported; use {', '.join(ITEM_TYPES)}")


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")
