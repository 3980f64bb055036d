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


def usage_of(ev: dict[str, Any]) -> Usage:
    return Usage(int(ev.get("pt", 0)), int(ev.get("ct", 0)))


def _usage(ev: dict[str, Any]) -> dict[str, int]:
    pt, ct = int(ev.get("pt", 0)), int(ev.get("ct", 0))
    return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}


def final_body(kind: str, rid: str, model: str, created: int, ev: dict[str, Any]) -> dict[str, Any]:
    text = ev.get("x", "")
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": ev.get("fr", "stop"), "logprobs": None}
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": _usage(ev)}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": ev.get("fr", "stop"), "logprobs": None}],
            "usage": _usage(ev)}


async def sse(orphans: Orphans, line: Line, rid: str, kind: str, body: ChatBody | CompletionBody,
               first: dict[str, Any], stream: AsyncIterator[dict[str, Any]], created: int,
               rec: RequestRecorder, ticket: Ticket) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format, ending in `data: [DONE]`."""
    chat = kind == "chat"
    base: dict[str, Any] = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": body.model}

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"

    # A token's chunk is the same bytes around its text: encode those once, then per token
    # only the text (no dicts built, one join).
    head, _, tail = chunk("\x00").rpartition(b'"\\u0000"')

    def token(text: str) -> bytes:
        return b"".join((head, orjson.dumps(text), tail))

    finished = False
    end: tuple[str, Usage | None] = ("cancelled", None)  # the outcome the ticket closes with
    try:
        # Chunks known together go out in one write: the role chunk with the first event's, the
        # last chunk with the usage chunk and [DONE] (fewer writes for the gateway and the caller).
        opening = chunk("", role=True) if chat else b""
        ev = first
        while True:
            if ev["t"] == "tok":
                yield opening + token(ev["x"]) if opening else token(ev["x"])
                opening = b""
            elif ev["t"] == "done":
                finished = True
                end = ("completed", usage_of(ev))
                rec.done(ev)
                opening += chunk(None if chat else "", finish=ev.get("fr", "stop"))
                if body.include_usage():
                    opening += b"data: " + orjson.dumps({**base, "choices": [], "usage": _usage(ev)}) + b"\n\n"
                break
            else:
                finished = True
                end = (outcome_of(ev), None)
                opening += b"data: " + orjson.dumps(from_event(ev).body()) + b"\n\n"
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
                opening = b"data: " + orjson.dumps(unavailable_error(e).body()) + b"\n\n"
                break
        yield opening + b"data: [DONE]\n\n"
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
