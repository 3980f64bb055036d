"""What a caller reads back: a completion's JSON body, or its server-sent events.

The stream always ends the documented way: the last chunk (or a final `error`
event: the fleet failed it, or its Redis went away mid-stream) and then
`data: [DONE]`, never a connection cut without an end.

The answer owns its call's end (`Ending`): `whole` ends the call in its own `finally`, a
stream's response (`SSEResponse`) in its own, once, whether or not a byte was sent; the
outcome is `fleet.outcome.infer_outcome` of what ended it (the worker's final event, an
exception, the caller leaving).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import orjson
from redis.exceptions import RedisError
from starlette.responses import Response, StreamingResponse

from fleet.outcome import CallerLeft, infer_outcome
from fleet.store.events import Chunk, Done, Event, Failed
from gateway.client_watch import ClientWatch
from gateway.errors import APIError, from_event
from gateway.redis_loss import unavailable_error
from gateway.tickets import Usage

if TYPE_CHECKING:
    from gateway.call import Call

log = logging.getLogger("fleet.gateway")

Cause = Done | Failed | BaseException | type[BaseException] | None


@dataclass(slots=True)
class Ending:
    """What ended a call's answer, as far as the answer got: the worker's final event, the exception
    that stopped it, or (until one of those) `CallerLeft`, the caller gone. The answer ends its call
    with it once, in its own `finally`: in the line already when the worker's event ended it."""

    cause: Cause = CallerLeft

    async def end(self, call: Call) -> None:
        c = self.cause
        usage = usage_of(c) if isinstance(c, Done) else None
        await call.end(infer_outcome(c), usage, in_line=isinstance(c, Done | Failed))



class SSEResponse(StreamingResponse):
    """Starlette's StreamingResponse, with its first bytes written on the call's own task, and
    the call's one client watcher (`gateway.client_watch`) to cut it short.

    Under an ASGI server of spec < 2.4 (uvicorn says 2.3) Starlette streams from a new task of an
    anyio task group while the call's task listens for the client's disconnect: a task and a loop
    turn before the headers and the first chunk go out. Here the call's task streams; when the
    client leaves, the watcher cancels it, which ends the stream the way Starlette's does (the
    generator's clean-up runs, the response returns)."""

    def __init__(self, content: AsyncGenerator[bytes, None], call: Call, ending: Ending | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=call.headers)
        self.client: ClientWatch = call.client
        self.call = call
        self.content = content
        self.ending = ending or Ending()  # what `content` writes as it goes: how the call ended

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        me = asyncio.current_task()
        state = {"gone": False, "done": False}

        def left() -> None:
            if not state["done"] and me is not None:  # after the last chunk, receive says disconnect too
                state["gone"] = True
                me.cancel()

        self.client.on_gone(left)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["gone"] or me is None:
                raise  # cancelled from outside (shutdown): not ours to swallow
            me.uncancel()  # the client left: the stream ended, as Starlette's task group ends it
        finally:
            state["done"] = True
            # The response owns the call's end, however it stops, and ends it here once: as the
            # stream recorded in its `Ending` (the worker's last event, Redis gone), else (the
            # client gone, before the first byte or while a chunk was being sent) as cancelled.
            # Shielded: Starlette's scope may be cancelling this task, which would cancel every await.
            with anyio.CancelScope(shield=True):
                await self.content.aclose()
                await self.ending.end(self.call)


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


class Render(Protocol):
    """How a streamed call's events become bytes: chat's chunks (`_Chunks`) or the Responses API's
    events (`gateway.responses_stream`). `done` and `error` give the stream's last bytes."""

    def chunk(self, c: Chunk) -> bytes: ...

    async def done(self, ev: Done) -> bytes: ...

    def error(self, err: APIError) -> bytes: ...


class _Chunks:
    """The SSE chunks of one streamed call: a chunk's bytes are the same around the members the
    worker wrote (`fleet.store.events.Chunk`), so those are spliced in as they are."""

    def __init__(self, kind: str, rid: str, model: str, created: int, include_usage: bool = False) -> None:
        self.chat = kind == "chat"
        self.include_usage = include_usage
        self.opened = not self.chat  # a completion's stream has no role chunk
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

    def chunk(self, c: Chunk) -> bytes:
        """A chunk's bytes; the first of a chat stream after the role chunk, sent in one write. The
        chunk is made first: it may name the engine's model, which the role chunk then bears."""
        out = self.of(c)
        if not self.opened:
            out, self.opened = self.opening() + out, True
        return out

    async def done(self, ev: Done) -> bytes:
        """The last chunk, the usage chunk when asked, and [DONE] (the role chunk first if none went)."""
        return self._opening() + self.end(ev, self.include_usage) + b"data: [DONE]\n\n"

    def error(self, err: APIError) -> bytes:
        return self._opening() + b"data: " + orjson.dumps(err.body()) + b"\n\n" + b"data: [DONE]\n\n"

    def _opening(self) -> bytes:
        if self.opened:
            return b""
        self.opened = True
        return self.opening()

    def end(self, ev: Done, include_usage: bool) -> bytes:
        """The last chunk (its finish reason) and, when the caller asked, the usage chunk."""
        self.model(ev.model)
        member = {"delta": {}} if self.chat else {"text": ""}
        extra = dict(ev.extra or {})
        last: dict[str, Any] = {"index": 0, **member, "logprobs": None, "finish_reason": ev.finish_reason}
        if "stop_reason" in extra:  # the stop string met: on the choice, where vLLM's own stream has it
            last["stop_reason"] = extra.pop("stop_reason")
        out = self._event({"choices": [last], **extra})
        if include_usage:
            out += self._event({"choices": [], "usage": _usage(ev), **extra})
        return out


# Writes a whole answer's response from the worker's done event (chat's JSON unless another API's).
Make = Callable[["Call", Done], Awaitable[Response]]


async def _chat_body(call: Call, done: Done) -> Response:
    body = final_body(call.spec.kind, call.rid, call.spec.body.model, call.created, done)
    return Response(orjson.dumps(body), media_type="application/json", headers=call.headers)


async def whole(call: Call, first: Done | Chunk, make: Make | None = None) -> Response:
    """A call answered whole: its one body, as `make` writes it (chat's or a completion's JSON by
    default). It owns the call's end, in its own `finally`, once: completed with its usage when the
    worker's answer came whole (whatever writing the body then does: a Response the store cannot
    keep is still an answer the engine made), else as the exception that stopped it says."""
    ending = Ending(None)
    try:
        if not isinstance(first, Done):  # a chunk for a call that was not streamed: the worker's fault
            raise APIError(502, "the worker streamed an answer that was asked for whole", "engine_error",
                           code="bad_answer")
        ending.cause = first
        call.completed(first)
        return await (make or _chat_body)(call, first)
    except BaseException as e:
        if ending.cause is None:
            ending.cause = e
        raise
    finally:
        with anyio.CancelScope(shield=True):  # the end must run even while being cancelled
            await ending.end(call)


def stream(call: Call, first: Chunk | Done, render: Render | None = None) -> SSEResponse:
    """A streamed call's response (chat's chunks unless given another `render`); the response ends
    the call when it stops, however it stops (`SSEResponse`)."""
    spec = call.spec
    render = render or _Chunks(spec.kind, call.rid, spec.body.model, call.created, spec.body.include_usage())
    ending = Ending()
    return SSEResponse(_sse(call, first, render, ending), call, ending)


async def _sse(call: Call, first: Event, render: Render, ending: Ending) -> AsyncGenerator[bytes, None]:
    """The call's server-sent events, as `render` writes them; what ended it goes in `ending` (its
    response ends the call with it)."""
    # Chunks known together go out in one write: the role chunk with the first event's, the
    # last chunk with the usage chunk and [DONE] (fewer writes for the gateway and the caller).
    ev = first
    while True:
        if isinstance(ev, Chunk):
            yield render.chunk(ev)
        else:
            ending.cause = ev
            if isinstance(ev, Done):
                call.completed(ev)
                last = await render.done(ev)
            else:
                last = render.error(from_event(ev))
            break
        try:
            ev = await call.next()
        except (RedisError, TimeoutError) as e:
            # Redis dropped or froze mid-stream: the documented end, not a cut connection. The
            # request is ended in the line once Redis answers (the orphan sweep).
            ending.cause = e
            log.error("stream %s: Redis unavailable (%s)", call.rid, type(e).__name__)
            last = render.error(unavailable_error(e))
            break
    yield last
