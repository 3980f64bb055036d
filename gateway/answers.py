"""What a caller reads back: a completion's JSON body, or its server-sent events.

The stream always ends the documented way: the last chunk (or a final `error`
event: the fleet failed it, or its Redis went away mid-stream) and then
`data: [DONE]`, never a connection cut without an end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import orjson
from redis.exceptions import RedisError
from starlette.responses import StreamingResponse

from fleet.store.events import Chunk, Done, Event
from fleet.store.line import Line
from gateway.errors import from_event
from gateway.observability import RequestRecorder
from gateway.redis_loss import UNAVAILABLE, Orphans, end_in_line, spawn, unavailable_error
from gateway.results import close_events
from gateway.schemas import ChatBody, CompletionBody
from gateway.tickets import Ticket, Usage, outcome_of

log = logging.getLogger("fleet.gateway")


class SSEResponse(StreamingResponse):
    """Starlette's StreamingResponse, with its first bytes written on the call's own task.

    Under an ASGI server of spec < 2.4 (uvicorn says 2.3) Starlette streams from a new task of an
    anyio task group while the call's task listens for the client's disconnect: a task and a loop
    turn before the headers and the first chunk go out. Here the call's task streams, and the
    listener is the task started beside it; when the client leaves it cancels the stream, which
    ends the way Starlette's does (the generator's clean-up runs, the response returns)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        me = asyncio.current_task()
        state = {"gone": False, "done": False}

        async def listen() -> None:
            message = await receive()
            while message["type"] != "http.disconnect":  # a body the client still sends: not ours to read
                message = await receive()
            if not state["done"] and me is not None:  # after the last chunk, receive says disconnect too
                state["gone"] = True
                me.cancel()

        listener = asyncio.ensure_future(listen())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["gone"] or me is None:
                raise  # cancelled from outside (shutdown): not ours to swallow
            me.uncancel()  # the client left: the stream ended, as Starlette's task group ends it
        finally:
            state["done"] = True
            listener.cancel()


def usage_of(ev: Done) -> Usage:
    return Usage(ev.prompt_tokens, ev.completion_tokens)


def _usage(ev: Done) -> dict[str, Any]:
    """The engine's usage object, whole (details included), with its total."""
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens, **ev.usage}


def final_body(kind: str, rid: str, model: str, created: int, ev: Done) -> dict[str, Any]:
    """A call answered whole: the engine's choice as it came, under the fleet's id (and the
    engine's model name where it has one)."""
    chat = kind == "chat"
    choice: dict[str, Any] = {"index": 0}
    choice.update(ev.choice or ({"message": {"role": "assistant", "content": ""}} if chat else {"text": ""}))
    choice.setdefault("logprobs", None)
    choice["finish_reason"] = ev.finish_reason
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": ev.model or model, "choices": [choice], "usage": _usage(ev),
            **(ev.extra or {})}


class _Chunks:
    """The SSE chunks of one streamed call: a chunk's bytes are the same around the members the
    worker wrote (`fleet.store.events.Chunk`), so those are spliced in as they are."""

    def __init__(self, kind: str, rid: str, model: str, created: int) -> None:
        self.chat = kind == "chat"
        self.base: dict[str, Any] = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{rid}",
                                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                                     "created": created, "model": model}
        self._frame()

    def _frame(self) -> None:
        whole = b"data: " + orjson.dumps({**self.base, "choices": [{"index": 0, "x": 0, "finish_reason": None}]})
        self.head, _, self.tail = whole.rpartition(b'"x":0')
        self.tail += b"\n\n"

    def model(self, name: str | None) -> None:
        """The engine's name for its model, from the event that first gives it (once a call)."""
        if name is not None and name != self.base["model"]:
            self.base["model"] = name
            self._frame()

    def of(self, c: Chunk) -> bytes:
        self.model(c.model)
        return b"".join((self.head, c.body, self.tail))

    def opening(self) -> bytes:
        """A chat stream's first chunk: the role."""
        return self.head + b'"delta":{"role":"assistant","content":""},"logprobs":null' + self.tail

    def _event(self, obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({**self.base, **obj}) + b"\n\n"

    def end(self, ev: Done, include_usage: bool) -> bytes:
        """The last chunk (its finish reason) and, when the caller asked, the usage chunk."""
        self.model(ev.model)
        member = {"delta": {}} if self.chat else {"text": ""}
        extra = ev.extra or {}
        out = self._event({"choices": [{"index": 0, **member, "logprobs": None, "finish_reason": ev.finish_reason}],
                           **extra})
        if include_usage:
            out += self._event({"choices": [], "usage": _usage(ev), **extra})
        return out


async def sse(orphans: Orphans, line: Line, rid: str, kind: str, body: ChatBody | CompletionBody,
               first: Event, stream: AsyncIterator[Event], created: int,
               rec: RequestRecorder, ticket: Ticket) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format, ending in `data: [DONE]`."""
    chunks = _Chunks(kind, rid, body.model, created)
    finished = False
    end: tuple[str, Usage | None] = ("cancelled", None)  # the outcome the ticket closes with
    try:
        # Chunks known together go out in one write: the role chunk with the first event's, the
        # last chunk with the usage chunk and [DONE] (fewer writes for the gateway and the caller).
        opened = not chunks.chat  # a completion's stream has no role chunk
        ev = first
        while True:
            if isinstance(ev, Chunk):
                out = chunks.of(ev)  # first: it may name the engine's model, which the role chunk then bears
                if not opened:
                    out, opened = chunks.opening() + out, True
                yield out
                last = b""
            else:
                finished = True
                if isinstance(ev, Done):
                    end = ("completed", usage_of(ev))
                    rec.done(ev)
                    last = chunks.end(ev, body.include_usage())
                else:
                    end = (outcome_of(ev), None)
                    last = b"data: " + orjson.dumps(from_event(ev).body()) + b"\n\n"
                if not opened:
                    last = chunks.opening() + last
                break
            try:
                ev = await stream.__anext__()
            except (RedisError, TimeoutError) as e:
                # Redis dropped or froze mid-stream: the documented end, not a cut connection. The
                # request is ended in the line once Redis answers (the orphan sweep).
                finished = True
                end = (UNAVAILABLE, None)
                orphans.add(line, rid, UNAVAILABLE, ticket)
                log.error("stream %s: Redis unavailable (%s)", rid, type(e).__name__)
                last = b"data: " + orjson.dumps(unavailable_error(e).body()) + b"\n\n"
                break
        yield last + b"data: [DONE]\n\n"
    finally:
        # The response task may be being cancelled (the client left): Starlette cancels
        # it through an anyio scope, which would cancel every await here again, so the
        # clean-up runs in a shielded scope of its own.
        with anyio.CancelScope(shield=True):
            if not finished:
                # The client left mid-stream: abort the work in its engine. The outcome counted is
                # the one the line recorded (a worker may have completed it a moment before).
                ended = await end_in_line(line, rid, "cancelled")
                if ended is None:
                    orphans.add(line, rid, "cancelled", ticket)
                end = (ended or "cancelled", None)
            if end[0] != UNAVAILABLE and not ticket.recorded:
                spawn(ticket.close(*end))  # Redis calls of its own: off the closing response's path
            spawn(close_events(stream))
