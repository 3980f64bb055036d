"""The engine contract: what a worker needs from whatever runs the model.

A worker owns exactly one engine. It calls `start` once (weights load and
warm-up happen there, so the measured cold start is honest), then calls
`generate` for each claimed request and `abort` when the request is
cancelled, its client leaves, or its deadline passes.

Engines answer in OpenAI's terms (`Delta`): what the engine made reaches the caller
whole, tool calls, logprobs, refusals and reasoning included. What an engine cannot do
is an `EngineError` of type `invalid_request_error` (a typed 400 for the caller) naming
the field, never a silent drop.

What else the worker reads of an engine (its measured cold start and its phases, its name for the model,
its KV cache's size, the tokens a call that ended made) are members of `Engine` too, each
with the default an engine without it means: an engine subclasses `Engine` and overrides
those it has, so the worker reads each directly and never asks whether it is there. Which
engines there are is `workers.engines.registry`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Self

from fleet.config import TierConfig
from fleet.policy.cold_start import ColdStartPhases


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
    """What a worker needs of whatever runs the model. The lifecycle and the calls (`start`,
    `generate`, `abort`, `stop`) every engine implements; the capabilities after them have
    defaults, and an engine that has one overrides it (as a property, or as an attribute declared
    on its class: an instance attribute alone cannot shadow a property)."""

    @classmethod
    def for_tier(cls, tier: TierConfig, *, time_scale: float = 1.0) -> Self:
        """The engine a replica of `tier` runs (`workers.engines.registry.build_engine`); `time_scale`
        speeds up an engine that keeps its own clock (the sim's, in tests)."""
        raise NotImplementedError(f"{cls.__name__} is not built by name")

    async def start(self) -> None:
        """Load and warm up: everything the cold start measures. Called once."""
        ...

    def generate(self, req: EngineRequest) -> AsyncGenerator[Delta, None]:
        """The answer as deltas. The worker closes the generator when it stops reading (a deadline,
        a cancel): the engine frees the call's KV there."""
        ...

    async def abort(self, request_id: str) -> None:
        """End a running call: its `generate` ends without a finish. Harmless for an unknown id."""
        ...

    async def stop(self) -> None: ...

    # --- capabilities: what the worker reads, with the default an engine without it means ---

    @property
    def cold_start_s(self) -> float:
        """Seconds `start` took by the engine's own clock (a sped-up sim's are the model's);
        0: it has none, and the worker times `start` itself."""
        return 0.0

    @property
    def cold_start_phases(self) -> ColdStartPhases | None:
        """Its cold start by phase (`fleet.policy.cold_start`: load, init, first_token), known once
        started; None: it cannot tell them apart, and the replica reports the whole only."""
        return None

    @property
    def model_name(self) -> str | None:
        """The engine's own name for its model, which each answer's `model` carries; None: none
        (the answer then carries the name the caller used)."""
        return None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens its KV cache holds, known once started: the replica runs no more calls at once than
        fit at the tier's typical shape (`fleet.policy.replica_concurrency`); None: slots alone bound it."""
        return None

    def made(self, request_id: str) -> int:
        """Tokens made for a call that ended, asked once, to charge a call cut short: an engine that
        answers whole without saying how far it got (vLLM's final-only outputs) counts them
        meanwhile; 0: its deltas said it all."""
        return 0
