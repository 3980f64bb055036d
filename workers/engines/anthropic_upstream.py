"""An upstream's Anthropic Messages answers as the chat answers the pipeline carries: pure, no I/O.

The `openai` engine forwards a Messages call to an upstream's own `/v1/messages` when the tier's
`openai.upstream_api` is `messages` (the caller's Anthropic body whole: tools, system blocks,
thinking). The worker and the gateway carry chat answers, so the upstream's message (whole) or
events (streamed) become a chat completion or chat chunks, which the gateway maps back to
Anthropic's shape: text -> content, thinking -> reasoning_content, tool_use -> tool_calls
(streamed input_json_delta -> argument fragments by index), stop_reason -> finish_reason,
usage -> prompt/completion tokens.
"""

from __future__ import annotations

from typing import Any

import orjson

from fleet.engine_config import ANTHROPIC_BODY

ANTHROPIC_VERSION = "2023-06-01"
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
          "refusal": "content_filter", "pause_turn": "stop"}


def messages_body(req_body: dict[str, Any], model: str, stream: bool, max_tokens: int) -> dict[str, Any]:
    """The caller's Messages body for the upstream: its model, how it is read, the fleet's output bound."""
    body = dict(req_body[ANTHROPIC_BODY])
    body.update(model=model, stream=stream, max_tokens=max_tokens)
    return body


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage as chat's: the prompt is all input, cached or not; the cached part rides in
    `prompt_tokens_details`, from which the gateway writes `cache_read_input_tokens` back."""
    cached = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
    completion = int(usage.get("output_tokens") or 0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def chat_answer(message: dict[str, Any]) -> dict[str, Any]:
    """A whole Anthropic message as a chat completion body."""
    text, reasoning, calls = "", "", []
    for block in message.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            text += block.get("text") or ""
        elif kind == "thinking":
            reasoning += block.get("thinking") or ""
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": orjson.dumps(block.get("input") or {}).decode()}})
    out: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = reasoning
    finish = FINISH.get(message.get("stop_reason") or "end_turn", "stop")
    choice: dict[str, Any] = {"index": 0, "message": out, "finish_reason": finish}
    if message.get("stop_reason") == "stop_sequence":  # named as vLLM names it, so the gateway says which
        choice["stop_reason"] = message.get("stop_sequence")
    return {"id": message.get("id"), "object": "chat.completion", "model": message.get("model"),
            "choices": [choice],
            "usage": _usage(message.get("usage") or {})}


class StreamMap:
    """Feed it the upstream's stream events in order; each gives the chat chunks it stands for."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] = {}
        self.tools: dict[int, int] = {}  # an Anthropic content block's index -> its tool call's index

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind == "message_start":
            self.usage.update((event.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                at = self.tools[int(event.get("index") or 0)] = len(self.tools)
                return [_chunk({"tool_calls": [{"index": at, "id": block.get("id"), "type": "function",
                                                "function": {"name": block.get("name"), "arguments": ""}}]})]
            if block.get("type") == "text" and block.get("text"):
                return [_chunk({"content": block["text"]})]
        elif kind == "content_block_delta":
            return self._delta(int(event.get("index") or 0), event.get("delta") or {})
        elif kind == "message_delta":
            self.usage.update(event.get("usage") or {})
            delta = event.get("delta") or {}
            stop = delta.get("stop_reason")
            if stop:
                last = _chunk({}, FINISH.get(stop, "stop"))
                if stop == "stop_sequence" and delta.get("stop_sequence"):  # named as vLLM's stream names it
                    last["choices"][0]["stop_reason"] = delta["stop_sequence"]
                return [last, {"choices": [], "usage": _usage(self.usage)}]
        return []  # ping, content_block_stop, message_stop

    def _delta(self, index: int, delta: dict[str, Any]) -> list[dict[str, Any]]:
        kind = delta.get("type")
        if kind == "text_delta":
            return [_chunk({"content": delta.get("text") or ""})]
        if kind == "thinking_delta":
            return [_chunk({"reasoning_content": delta.get("thinking") or ""})]
        if kind == "input_json_delta" and index in self.tools:
            return [_chunk({"tool_calls": [{"index": self.tools[index],
                                            "function": {"arguments": delta.get("partial_json") or ""}}]})]
        return []  # signature_delta and what this fleet does not carry


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
