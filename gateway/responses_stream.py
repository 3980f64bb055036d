"""A streamed Responses call: the chat deltas its call streams, as the Responses API's events.

A render (`gateway.answers.Render`) over the same events a chat stream reads, in OpenAI's order:

    response.created, response.in_progress                      (before the first delta)
    response.output_item.added                                  (an item opens: message, function_call, reasoning)
      response.content_part.added, response.output_text.delta*, response.output_text.done,
      response.content_part.done                                (a message's text)
      response.function_call_arguments.delta*, .done            (a function call's arguments)
      response.reasoning_text.delta*, .done                     (reasoning, where the engine gives it)
    response.output_item.done                                   (it closes: the next one opens, or the end)
    response.completed | response.incomplete                    (stored first: a continuation may follow at once)
    response.failed                                             (a refusal, the deadline, a lost worker, Redis)

each as `event: <type>` and `data: <json>` with its `sequence_number`. Items are streamed one
after another: an item opens when the first delta of another kind (or another tool call's index)
arrives, which closes the one before. No `[DONE]` follows: OpenAI's Responses streams end with
their terminal event, and that is what its clients read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from fleet.store.events import Chunk, Done
from gateway.errors import APIError
from gateway.responses_map import (
    REASONING_KEYS,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
)

Finish = Callable[[list[dict[str, Any]], Done], Awaitable[dict[str, Any]]]


class ResponsesRender:
    """One streamed response's events. `head` is the Response as created (status in_progress);
    `finish` stores the completed one and returns it (raising a typed error if it cannot)."""

    def __init__(self, head: dict[str, Any], finish: Finish) -> None:
        self.head, self.finish = head, finish
        self.seq = 0
        self.started = False
        self.items: list[dict[str, Any]] = []  # the output so far, in order
        self.open: int | None = None  # the output index of the item being streamed
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its output index

    # --- the render -------------------------------------------------------------------------

    def chunk(self, c: Chunk) -> bytes:
        out = self._start()
        delta = c.members().get("delta") or {}
        for key in REASONING_KEYS:
            if delta.get(key):
                out += self._reasoning(str(delta[key]))
        if delta.get("content"):
            out += self._text(str(delta["content"]))
        if delta.get("refusal"):
            out += self._refusal(str(delta["refusal"]))
        for frag in delta.get("tool_calls") or ():
            if isinstance(frag, dict):
                out += self._call(frag)
        return out

    async def done(self, ev: Done) -> bytes:
        out = self._start() + self._close()
        for item in self.items:
            item["status"] = "completed"
        try:
            response = await self.finish(self.items, ev)
        except APIError as e:  # answered, but not stored: the caller must not continue from it
            return out + self.error(e)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=response)

    def error(self, err: APIError) -> bytes:
        out = self._start() + self._close()
        failed = {**self.head, "status": "failed", "output": self.items,
                  "error": {"code": err.code or err.type, "message": err.message}}
        return out + self._event("response.failed", response=failed)

    # --- the items --------------------------------------------------------------------------

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return self._event("response.created", response=self.head) + self._event("response.in_progress",
                                                                                 response=self.head)

    def _current(self, kind: str) -> dict[str, Any] | None:
        item = self.items[self.open] if self.open is not None else None
        return item if item is not None and item["type"] == kind else None

    def _add(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.items.append(item)
        self.open = len(self.items) - 1
        return out + self._event("response.output_item.added", output_index=self.open, item=_shown(item))

    def _text(self, text: str) -> bytes:
        item, out = self._current("message"), b""
        if item is None:
            item = message_item("", item_id=new_id("msg"), status="in_progress")
            out = self._add(item) + self._event("response.content_part.added", item_id=item["id"],
                                                output_index=self.open, content_index=0, part=_empty_text())
        item["content"][0]["text"] += text
        return out + self._event("response.output_text.delta", item_id=item["id"], output_index=self.open,
                                 content_index=0, delta=text, logprobs=[])

    def _refusal(self, text: str) -> bytes:
        item, out = self._current("message"), b""
        if item is None:  # a refusal alone: its message has no text part worth streaming
            out = self._text("")
            item = self._current("message")
            assert item is not None
        parts = item["content"]
        if parts[-1]["type"] != "refusal":
            parts.append({"type": "refusal", "refusal": ""})
        parts[-1]["refusal"] += text
        return out

    def _reasoning(self, text: str) -> bytes:
        item, out = self._current("reasoning"), b""
        if item is None:
            item = reasoning_item("", item_id=new_id("rs"))
            out = self._add(item)
        item["content"][0]["text"] += text
        return out + self._event("response.reasoning_text.delta", item_id=item["id"], output_index=self.open,
                                 content_index=0, delta=text)

    def _call(self, frag: dict[str, Any]) -> bytes:
        index = frag.get("index", 0) if isinstance(frag.get("index", 0), int) else 0
        fn = frag.get("function") if isinstance(frag.get("function"), dict) else {}
        out = b""
        at = self.calls.get(index)
        if at is None:
            item = function_call_item(frag.get("id"), str(fn.get("name") or ""), "", item_id=new_id("fc"),
                                      status="in_progress")
            out = self._add(item)
            at = self.calls[index] = len(self.items) - 1
        item = self.items[at]
        args = fn.get("arguments")
        if args:
            item["arguments"] += str(args)
            out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                               delta=str(args))
        return out

    def _close(self) -> bytes:
        """The done events of the item being streamed (none open: nothing)."""
        if self.open is None:
            return b""
        at, self.open = self.open, None
        item = self.items[at]
        item["status"] = "completed"
        out = b""
        if item["type"] == "message":
            for ci, part in enumerate(item["content"]):
                if part["type"] == "output_text":
                    out += self._event("response.output_text.done", item_id=item["id"], output_index=at,
                                       content_index=ci, text=part["text"], logprobs=[])
                else:
                    out += self._event("response.content_part.added", item_id=item["id"], output_index=at,
                                       content_index=ci, part={"type": "refusal", "refusal": ""})
                    out += self._event("response.refusal.done", item_id=item["id"], output_index=at,
                                       content_index=ci, refusal=part["refusal"])
                out += self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                   content_index=ci, part=part)
        elif item["type"] == "function_call":
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                               name=item["name"], arguments=item["arguments"])
        else:
            out += self._event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                               content_index=0, text=item["content"][0]["text"])
        return out + self._event("response.output_item.done", output_index=at, item=item)

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = orjson.dumps({"type": kind, **fields, "sequence_number": self.seq})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


def _empty_text() -> dict[str, Any]:
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def _shown(item: dict[str, Any]) -> dict[str, Any]:
    """An item as `output_item.added` shows it: nothing streamed into it yet."""
    if item["type"] == "message":
        return {**item, "content": []}
    if item["type"] == "reasoning":
        return {**item, "content": []}
    return {**item, "arguments": ""}
