"""The engine contract: what a worker needs from whatever runs the model.

A worker owns exactly one engine. It calls `start` once (weights load and
warm-up happen there, so the measured cold start is honest), then calls
`generate` for each claimed request and `abort` when the request is
cancelled, its client leaves, or its deadline passes.

Engines answer in OpenAI's terms (`Delta`): what the engine made reaches the caller
whole, tool calls, logprobs, refusals and reasoning included. What an engine cannot do
is an `EngineError` of type `invalid_request_error` (a typed 400 for the caller) naming
the field, never a silent drop. An engine may set `model_name`: its own name for the
model, which the caller sees in the answer's `model`; and an engine that answers a call
whole without saying how far it got (vLLM's final-only outputs) may offer
`made(request_id) -> int`, the tokens it made for a call that ended, so a call cut short
is still charged what it cost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol


class EngineError(Exception):
    """A typed failure the worker turns into an error event for the caller."""

    def __init__(self, message: str, type_: str = "engine_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.type = type_
        self.code = code
        self.param = param  # the field of the caller's request at fault, when one is


@dataclass(slots=True)
class EngineRequest:
    """One call for an engine: the caller's OpenAI request as it sent it (`body`), and what
    the fleet decided about it. An engine reads its sampling fields, tools, response format
    and messages from `body`; it must not answer past `max_tokens`."""

    request_id: str
    kind: Literal["chat", "completion"]
    body: dict[str, Any]
    max_tokens: int = 16  # the fleet's bound: the caller's, else the tier's default
    # The caller reads a stream of tokens; False lets an engine answer whole (a forwarding one
    # asks its upstream for one body, which costs less than a chunk per token).
    stream: bool = True
    # The request's class rank (fleet.config.Priority): a lower number goes first, as in vLLM.
    priority: int = 0

    @classmethod
    def build(cls, request_id: str, kind: Literal["chat", "completion"], prompt: str | None = None, *,
              messages: list[dict[str, Any]] | None = None, max_tokens: int = 16, stream: bool = True,
              priority: int = 0, **fields: Any) -> EngineRequest:
        """A request from its parts, as tests and the engines' own warm-ups make one."""
        body: dict[str, Any] = {"max_tokens": max_tokens, **fields}
        if kind == "chat":
            body["messages"] = messages or []
        else:
            body["prompt"] = prompt or ""
        return cls(request_id, kind, body, max_tokens=max_tokens, stream=stream, priority=priority)

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        return self.body.get("messages") if self.kind == "chat" else None

    @property
    def prompt(self) -> str | None:
        if self.kind == "chat":
            return None
        p = self.body.get("prompt")
        return (p[0] if p else "") if isinstance(p, list) else p

    @property
    def ignore_eos(self) -> bool:
        return bool(self.body.get("ignore_eos"))


@dataclass(slots=True)
class Delta:
    """What an engine produced since its previous delta, with cumulative token counts.

    `text` is the answer's text (a chat delta's `content`, a completion's `text`): the
    common case, kept apart so that plain tokens cost no dict. `fields` holds the chat
    delta's other members as the engine sent them (`tool_calls` fragments with their
    `index`, `reasoning_content`, `refusal`, ...), `logprobs` the choice's. An engine that
    answers whole (the call was not streamed) gives one delta with `choice`: the engine's
    choice, less its index and finish reason. `usage` is the engine's own usage object
    when it has one; the worker passes it on whole."""

    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None  # on the last delta: "stop", "length", "tool_calls", ...
    fields: dict[str, Any] | None = None
    logprobs: Any = None
    choice: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None  # on the last delta: the answer's other top-level members (system_fingerprint)


class Engine(Protocol):
    async def start(self) -> None: ...

    def generate(self, req: EngineRequest) -> AsyncIterator[Delta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stop(self) -> None: ...
