"""One attempt of one call on the engine: run it, time it, and say how it ended.

`run_engine` feeds the engine's deltas to the caller (through the replica's
`StreamWriter`) or gathers them into the whole answer, and `Progress` keeps what the
worker needs to end the attempt: its time to first token and per output token, its
token counts and usage, its finish reason, and (not streamed) the answer itself, as the
engine gave it or merged from its deltas (`fleet.chat_shapes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from fleet.chat_shapes import merge_delta, merge_logprobs, message_of
from fleet.store.events import Done
from fleet.store.line import Claimed
from workers.engines.base import Delta, Engine, EngineRequest
from workers.preempting import Attempt
from workers.streaming import StreamWriter


@dataclass(slots=True)
class Progress:
    """What one attempt's engine produced so far."""

    t0: float = field(default_factory=time.monotonic)
    t_first: float = 0.0
    t_last: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    usage: dict[str, Any] | None = None
    choice: dict[str, Any] | None = None  # the engine's whole answer, when it gave one
    extra: dict[str, Any] | None = None  # the answer's other top-level members, as the engine gave them
    text: list[str] = field(default_factory=list)  # not streamed: the deltas gathered
    delta: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, Any] | None = None
    useful: bool = False  # completed on time, as recorded: its tokens are useful
    ended: bool | None = None  # for judging its version: ok, an error, or neither (cancelled, caller's fault)
    key: str = ""  # the caller's API key, which its tokens are charged to

    def took(self, d: Delta) -> None:
        now = time.monotonic()
        self.t_first = self.t_first or now
        self.t_last = now
        self.prompt_tokens, self.completion_tokens = d.prompt_tokens, d.completion_tokens
        if d.finish_reason:
            self.finish_reason = d.finish_reason
        if d.usage:
            self.usage = d.usage
        if d.choice is not None:
            self.choice = d.choice
        if d.extra:
            self.extra = d.extra

    def gather(self, d: Delta) -> None:
        if d.text:
            self.text.append(d.text)
        if d.fields:
            merge_delta(self.delta, d.fields)
        self.logprobs = merge_logprobs(self.logprobs, d.logprobs)

    @property
    def ttft_s(self) -> float:
        return (self.t_first or time.monotonic()) - self.t0

    @property
    def tpot_s(self) -> float:
        n = self.completion_tokens
        return (self.t_last - self.t_first) / (n - 1) if n > 1 else 0.0

    def answer(self, kind: str) -> dict[str, Any]:
        """The whole answer of a call that was not streamed, as an OpenAI choice (less index and finish)."""
        if self.choice is not None:
            return self.choice
        text = "".join(self.text)
        if kind != "chat":
            return {"text": text, "logprobs": self.logprobs}
        return {"message": message_of(merge_delta(dict(self.delta), {"content": text})), "logprobs": self.logprobs}

    def done(self, c: Claimed, req: EngineRequest, replica: str, model: str | None) -> Done:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, **(self.usage or {})}
        return Done(attempt=c.attempt, finish_reason=self.finish_reason, usage=usage, ttft_s=round(self.ttft_s, 6),
                    tpot_s=round(self.tpot_s, 6), wait_s=c.waited_ms / 1000, replica=replica,
                    choice=None if req.stream else self.answer(req.kind), model=model, extra=self.extra)


async def run_engine(engine: Engine, streams: StreamWriter, c: Claimed, req: EngineRequest, attempt: Attempt,
                     progress: Progress) -> None:
    """Run `req` on the engine to its end: a streamed call's deltas go to the caller as they come
    (what is still buffered at the end goes with its finish: `StreamWriter.rest`), a whole call's
    are gathered.
    Closing the engine's iterator on the way out frees its KV at once, however this ends."""
    async with contextlib.aclosing(engine.generate(req)) as deltas:
        async for d in deltas:
            progress.took(d)
            attempt.progress = d.completion_tokens
            if not req.stream:
                progress.gather(d)
            elif d.text or d.fields or d.logprobs:
                first, attempt.sent = not attempt.sent, True
                streams.push(c.lease, d)
                if first:  # the writer sends it now, not after the rest of a burst is read
                    await asyncio.sleep(0)
