"""Request bodies the gateway accepts: OpenAI's, validated, with unknown fields
passed over (clients send many we do not need)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extension: keep generating past EOS (tests and benchmarks need exact lengths).
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def wanted_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content if isinstance(part, dict))
        return self.content or ""


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(_Body):
    prompt: str | list[str] = Field(...)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return v

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
