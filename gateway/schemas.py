"""Request bodies the gateway accepts: OpenAI's, validated strictly where the fleet reads them.

The call that reaches the engine is the call the agent sent: the gateway forwards the body
as the bytes that arrived (`fleet.store.payloads`), every field OpenAI defines and any an
engine accepts (`guided_json`, `chat_template_kwargs`, ...), so unknown fields are allowed
here, not dropped. What the fleet uses itself is read strictly: `model`, `stream`,
`stream_options`, `max_tokens`, the messages' shape (for the token estimate admission
prices), and the agent fields whose size it counts (`tools`, `response_format`).
Strict: a number sent as a string (`"max_tokens": "10"`) or a boolean as a word (`"stream":
"yes"`) is a typed 422 naming the field, not a guess. Bounded: the body by the config's
`max_body_bytes`, and every list and string the fleet reads by a limit of its own. These
models are also what `/openapi.json` publishes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

MAX_MODEL_NAME = 256
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
MAX_METADATA_PAIRS = 16  # OpenAI's own limits on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_TOOLS = 128  # OpenAI's limit on tools per call
MAX_TOOL_CALLS = 128
MAX_NAME_CHARS = 256
MAX_SEED = 2**64 - 1  # the engines' generators take 64 bits
MIN_SEED = -(2**63)

# Strict where read; anything else the caller sends rides along to the engine.
_STRICT = ConfigDict(strict=True, extra="allow")
StopText = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)]
MetaKey = Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY_CHARS)]
MetaValue = Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE_CHARS)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class FunctionDef(BaseModel):
    """A function tool's definition; its `parameters` (a JSON schema) reach the engine byte for byte."""

    model_config = _STRICT

    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT

    type: Literal["function"] = "function"
    function: FunctionDef


class ResponseFormat(BaseModel):
    """`text`, `json_object`, or `json_schema` with its `json_schema` ({name, schema, strict})."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Body(BaseModel):
    model_config = _STRICT

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME, description="A tier or one of its aliases.")
    max_tokens: int | None = Field(None, ge=1, description="At most the tier's max_tokens_limit.")
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=1, description="One choice per request.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | StopList | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    metadata: dict[MetaKey, MetaValue] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    logprobs: bool | int | None = None  # chat: a boolean; completions: how many (0-5)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's extension: keep generating past EOS (tests and benchmarks need exact lengths).
    ignore_eos: bool = False

    def wanted_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    """A content part: `text`, `image_url`, `input_audio`, `file`, ... Every part goes to the
    engine; an engine that cannot take one refuses the call with a typed 400 naming it."""

    model_config = _STRICT

    type: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str | None = None
    arguments: str | None = None


class ToolCall(BaseModel):
    """An assistant turn's tool call, as the engine made it and the agent sends it back."""

    model_config = _STRICT

    id: Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)] | None = None


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class CompletionBody(_Body):
    """POST /v1/completions."""

    prompt: str | list[str] = Field(..., description="One prompt: a string, or a list holding exactly one.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return v

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error: OpenAI's shape. A 429 also carries tier, priority and retry_after_s in `error`."""

    error: ErrorDetail
