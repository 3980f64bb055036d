"""Request bodies the gateway accepts: OpenAI's, validated strictly and bounded.

Strict: a number sent as a string (`"max_tokens": "10"`) or a boolean as a
word (`"stream": "yes"`) is a typed 422 naming the field, not a guess.
Bounded: every field that reaches Redis (messages, prompt, stop sequences)
or that we keep at all (`user`, `metadata`) has a size limit, so the payload
a request stores is never much larger than its body (itself bounded by the
config's `max_body_bytes`). Unknown fields are passed over: clients send many
we do not need. These models are also what `/openapi.json` publishes.
"""

from __future__ import annotations

from typing import Annotated, Literal

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
MAX_SEED = 2**64 - 1  # the engines' generators take 64 bits
MIN_SEED = -(2**63)

_STRICT = ConfigDict(strict=True, extra="ignore")
StopText = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)]
MetaKey = Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY_CHARS)]
MetaValue = Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE_CHARS)]


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Body(BaseModel):
    model_config = _STRICT

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME, description="A tier or one of its aliases.")
    max_tokens: int | None = Field(None, ge=1, description="At most the tier's max_tokens_limit.")
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=1, description="One choice per request.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | StopList | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    metadata: dict[MetaKey, MetaValue] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    # vLLM's extension: keep generating past EOS (tests and benchmarks need exact lengths).
    ignore_eos: bool = False

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def wanted_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    """A content part; only text reaches an engine, so only text is accepted (an image would be dropped)."""

    model_config = _STRICT

    type: Literal["text"]
    text: str


class Message(BaseModel):
    # Extra fields (name, tool_call_id, ...) are passed over, as on the bodies.
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)


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
