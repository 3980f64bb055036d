"""A streamed Messages call: the chat deltas its call streams, as Anthropic's events.

A render (`gateway.answers.Render`) over the same events a chat stream reads, in Anthropic's order:

    message_start                                   (the message, empty, before the first block)
    ping                                            (as Anthropic's own streams send one there)
    content_block_start                             (a block opens: thinking, text, tool_use)
      content_block_delta*                          (thinking_delta, text_delta, input_json_delta)
    content_block_stop                              (it closes: the next one opens, or the end)
    message_delta                                   (stop_reason, stop_sequence, usage)
    message_stop
    error                                           (a refusal, the deadline, a lost worker, Redis)

each as `event: <type>` and `data: <json>`. Blocks stream one after another: a block opens when
the first delta of another kind (or another tool call's index) arrives, which closes the one
before. No `[DONE]` follows: Anthropic's streams end with `message_stop` (or `error`).
"""

from __future__ import annotations

from typing import Any

import orjson

from fleet.store.events import Chunk, Done
from gateway.errors import APIError
from gateway.messages_map import REASONING_KEYS, error_body, message_object, new_id, stop_of, usage_of


class MessagesRender:
    """One streamed message's events. `head` is the message as message_start shows it."""

    def __init__(self, head: dict[str, Any], stop_sequences: list[str] | None) -> None:
        self.head = head
        self.stop_sequences = stop_sequences
        self.started = False
        self.blocks = 0  # blocks opened so far: the next one's index
        self.open: str | None = None  # the kind of the block being streamed ("tool_use:<i>" for a call)
        self.tool_used = False  # a tool_use block was sent: the stop_reason is tool_use (`stop_of`)

    def chunk(self, c: Chunk) -> bytes:
        out = self._start(c.model)
        delta = c.members().get("delta") or {}
        for key in REASONING_KEYS:
            if delta.get(key):
                out += self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                   {"type": "thinking_delta", "thinking": str(delta[key])})
        if delta.get("content"):
            out += self._delta("text", {"type": "text", "text": ""},
                               {"type": "text_delta", "text": str(delta["content"])})
        for frag in delta.get("tool_calls") or ():
            if isinstance(frag, dict):
                out += self._call(frag)
        return out

    async def done(self, ev: Done) -> bytes:
        out = self._start(ev.model) + self._close()
        stop, seq = stop_of(ev, self.stop_sequences, self.tool_used)
        out += self._event("message_delta", delta={"stop_reason": stop, "stop_sequence": seq}, usage=usage_of(ev))
        return out + self._event("message_stop")

    def error(self, err: APIError) -> bytes:
        return self._start(None) + self._close() + self._event("error", **{"error": error_body(err)["error"]})

    def _start(self, model: str | None) -> bytes:
        if self.started:
            return b""
        self.started = True
        head = self.head if model is None else {**self.head, "model": model}
        # Anthropic's own streams send a ping after the start; clients that read the raw events
        # (not the SDKs, which skip it) expect one there.
        return self._event("message_start", message=head) + self._event("ping")

    def _delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> bytes:
        out = b""
        if self.open != kind:
            out = self._open(kind, block)
        return out + self._event("content_block_delta", index=self.blocks - 1, delta=delta)

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.open = kind
        self.blocks += 1
        return out + self._event("content_block_start", index=self.blocks - 1, content_block=block)

    def _call(self, frag: dict[str, Any]) -> bytes:
        index = frag.get("index", 0) if isinstance(frag.get("index", 0), int) else 0
        fn = frag.get("function") if isinstance(frag.get("function"), dict) else {}
        kind, out = f"tool_use:{index}", b""
        if self.open != kind:
            self.tool_used = True
            out = self._open(kind, {"type": "tool_use", "id": frag.get("id") or new_id("toolu"),
                                    "name": str(fn.get("name") or ""), "input": {}})
        args = fn.get("arguments")
        if args:
            out += self._event("content_block_delta", index=self.blocks - 1,
                               delta={"type": "input_json_delta", "partial_json": str(args)})
        return out

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return self._event("content_block_stop", index=self.blocks - 1)

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def head_of(msg_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The message as message_start shows it: no content, no stop, the estimated input."""
    return message_object(msg_id, model, [], None, input_tokens=input_tokens)
