"""OpenAI's streamed chunks as the engine contract's deltas: shared by the engines that speak
OpenAI (`openai` reads them from its upstream, `vllm` from vLLM's own serving layer).

A chunk's choice gives its text (`delta.content`, or a completion's `text`), the delta's
other members (tool-call fragments, `reasoning_content`, `refusal`) and its `logprobs`, each
passed on as the engine sent it. Whatever arrives with or after the finish reason rides in
the final delta, which also carries the engine's usage; without usage, completion tokens
are the chunks that held something.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fleet.chat_shapes import merge_delta, merge_logprobs
from workers.engines.base import Delta, EngineError

_NOT_FIELDS = ("content", "role")
EXTRA = ("system_fingerprint", "service_tier")  # an answer's top-level members that reach the caller as they came


def extra_of(answer: dict[str, Any]) -> dict[str, Any] | None:
    extra = {k: answer[k] for k in EXTRA if answer.get(k) is not None}
    return extra or None


class ChunkReader:
    """Feed it an answer's chunks in order (`feed`), then take its final delta (`end`)."""

    def __init__(self, chat: bool, prompt_estimate: Callable[[], int]) -> None:
        self.chat = chat
        self.prompt_estimate = prompt_estimate
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.chunks = 0  # chunks that held something: the count of tokens when no usage comes
        self.extra: dict[str, Any] | None = None
        self.stop_string: str | None = None  # the stop string the engine met (vLLM's choice `stop_reason`)
        self._held = Delta()  # what came with or after the finish reason

    def counts(self) -> tuple[int, int]:
        if self.usage:
            return int(self.usage.get("prompt_tokens") or 0), int(self.usage.get("completion_tokens") or self.chunks)
        return self.prompt_estimate(), self.chunks

    def feed(self, chunk: dict[str, Any]) -> Iterator[Delta]:
        """The deltas of one chunk, up to the finish reason (later ones are held for `end`)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if self.extra is None:
            self.extra = extra_of(chunk)
        for choice in chunk.get("choices") or ():
            text, fields, logprobs = self._parts(choice)
            if text or fields or logprobs:
                self.chunks += 1
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                if isinstance(choice.get("stop_reason"), str):
                    self.stop_string = choice["stop_reason"]
            if self.finish is not None:
                self._hold(text, fields, logprobs)
            elif text or fields or logprobs:
                prompt_tokens, completion_tokens = self.counts()
                yield Delta(text, prompt_tokens, completion_tokens, fields=fields, logprobs=logprobs)

    def _parts(self, choice: dict[str, Any]) -> tuple[str, dict[str, Any] | None, Any]:
        if not self.chat:
            return choice.get("text") or "", None, choice.get("logprobs")
        delta = choice.get("delta") or {}
        fields = {k: v for k, v in delta.items() if k not in _NOT_FIELDS and v not in (None, [], "")}
        return delta.get("content") or "", fields or None, choice.get("logprobs")

    def _hold(self, text: str, fields: dict[str, Any] | None, logprobs: Any) -> None:
        held = self._held
        held.text += text
        if fields:
            held.fields = merge_delta(held.fields or {}, fields)
        held.logprobs = merge_logprobs(held.logprobs, logprobs)

    def end(self) -> Delta:
        """The final delta: the finish reason, the engine's usage, and what was held."""
        if self.finish is None:
            raise EngineError("the engine ended the stream without a finish_reason", "upstream_error", "incomplete")
        prompt_tokens, completion_tokens = self.counts()
        held = self._held
        # The stop string rides with the answer's extras to the gateway, which puts it back on the
        # last chunk's choice (where vLLM has it) and names it to a Messages caller (`stop_sequence`).
        extra = {**(self.extra or {}), "stop_reason": self.stop_string} if self.stop_string else self.extra
        return Delta(held.text, prompt_tokens, completion_tokens, self.finish, fields=held.fields,
                     logprobs=held.logprobs, usage=self.usage, extra=extra)


def whole(answer: dict[str, Any], chat: bool) -> Delta:
    """A non-streamed answer (a chat completion or a completion body) as its one delta."""
    try:
        choice = dict(answer["choices"][0])
        finish = choice.pop("finish_reason", None) or "stop"
        choice.pop("index", None)
        if chat and not isinstance(choice.get("message"), dict):
            raise KeyError("message")
        usage = answer.get("usage") or None
    except (KeyError, IndexError, TypeError) as e:
        raise EngineError(f"the engine sent a malformed answer (no {e})", "upstream_error", "bad_response") from None
    counts = usage or {}
    return Delta("", int(counts.get("prompt_tokens") or 0), int(counts.get("completion_tokens") or 0), finish,
                 choice=choice, usage=usage, extra=extra_of(answer))
