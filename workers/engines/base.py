"""The engine contract: what a worker needs from whatever runs the model.

A worker owns exactly one engine. It calls `start` once (weights load and
warm-up happen there, so the measured cold start is honest), then calls
`generate` for each claimed request and `abort` when the request is
cancelled, its client leaves, or its deadline passes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol


class EngineError(Exception):
    """A typed failure the worker turns into an error event for the caller."""

    def __init__(self, message: str, type_: str = "engine_error", code: str | None = None) -> None:
        super().__init__(message)
        self.type = type_
        self.code = code


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    kind: Literal["chat", "completion"]
    prompt: str | None = None
    messages: list[dict[str, object]] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    # Test models with random weights emit EOS at random; callers that need an
    # exact token count (tests, benchmarks) set this.
    ignore_eos: bool = False
    # The caller reads a stream of tokens; False lets an engine that forwards (openai) ask
    # its upstream for one whole answer, which costs less than a chunk per token.
    stream: bool = True
    # The request's class rank (fleet.config.Priority): a lower number goes first, as in vLLM.
    priority: int = 0


@dataclass(slots=True)
class Delta:
    """New text since the previous delta, with cumulative token counts."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None  # "stop" | "length" on the last delta


class Engine(Protocol):
    async def start(self) -> None: ...

    def generate(self, req: EngineRequest) -> AsyncIterator[Delta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stop(self) -> None: ...
