"""The answer owns its call's end (`gateway.answers`): a whole answer ends it in its own `finally`,
a streamed one's response (`SSEResponse`) in its own, exactly once however it stops, the client
gone before the first byte included, with the outcome of what ended it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.responses import Response

from fleet.outcome import Outcome
from fleet.store.events import Chunk, Done, Event, Failed
from gateway.answers import Ending, SSEResponse, _Chunks, _sse, whole
from gateway.client_watch import ClientWatch
from gateway.errors import APIError

DONE = Done(attempt=1, finish_reason="stop", usage={"prompt_tokens": 3, "completion_tokens": 2})


class Ended:
    """What of a `Call` an answer touches: its headers, its client watch, its next events, and
    `end`, every call of which is kept (the real one acts on the first only)."""

    def __init__(self, receive: Any, later: list[Event | BaseException] | None = None) -> None:
        self.headers: dict[str, str] = {}
        self.client = ClientWatch(receive)
        self.rid = "r1"
        self.ends: list[tuple[Outcome, Any, bool]] = []
        self.later = list(later or [])

    @property
    def told(self) -> list[Outcome]:
        return [t for t, _, _ in self.ends]

    async def end(self, told: Outcome, usage: object = None, *, in_line: bool = False) -> None:
        self.ends.append((told, usage, in_line))

    def completed(self, done: Done) -> None:
        pass

    async def next(self) -> Event:
        got = self.later.pop(0) if self.later else None
        if got is None:
            await asyncio.Event().wait()  # nothing more yet: a worker still running
        if isinstance(got, BaseException):
            raise got
        assert got is not None
        return got


def stream_of(ending: Ending, n: int) -> AsyncGenerator[bytes, None]:
    """A stream of `n` chunks that records, once it has sent them all, that the call completed."""

    async def gen() -> AsyncGenerator[bytes, None]:
        for i in range(n):
            yield b"data: %d\n\n" % i
        ending.cause = DONE

    return gen()


async def run(call: Ended, body: AsyncGenerator[bytes, None], send: Any, ending: Ending | None = None) -> None:
    await SSEResponse(body, call, ending)({"type": "http"}, call.client._receive, send)  # type: ignore[arg-type]


async def gone_at_once() -> dict[str, str]:
    return {"type": "http.disconnect"}


async def stays() -> dict[str, str]:
    await asyncio.Event().wait()  # the client stays
    return {}


async def yields_once(_: dict[str, Any]) -> None:
    await asyncio.sleep(0)  # a server's send that yields once: the watcher cancels the stream here


async def test_a_client_gone_before_the_first_byte_still_ends_the_call() -> None:
    call, ending = Ended(gone_at_once), Ending()
    await run(call, stream_of(ending, 5), yields_once, ending)
    assert call.ends == [(Outcome.CANCELLED, None, False)]


async def test_a_stream_never_started_ends_its_call_as_cancelled() -> None:
    """The real stream (`_sse`) cut before its first chunk went out: its generator never ran."""
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)
        await asyncio.sleep(0)

    call, ending = Ended(gone_at_once), Ending()
    await run(call, _sse(call, Chunk(b'"delta":{"content":"hi"}'), _Chunks("chat", "r1", "m", 0), ending),  # type: ignore[arg-type]
              send, ending)
    assert call.told == [Outcome.CANCELLED]
    assert not any(m.get("body") for m in sent)  # not one byte of the answer went


async def test_a_stream_cut_while_sending_ends_the_call_as_cancelled_once() -> None:
    gone = asyncio.Event()
    sent: list[bytes] = []

    async def receive() -> dict[str, str]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg.get("body", b""))
        if len(sent) == 3:
            gone.set()
        await asyncio.sleep(0.01)

    call, ending = Ended(receive), Ending()
    await run(call, stream_of(ending, 1000), send, ending)
    assert call.told == [Outcome.CANCELLED] and len(sent) < 100


async def test_a_stream_that_finishes_ends_the_call_as_it_says() -> None:
    async def send(_: dict[str, Any]) -> None:
        return None

    call, ending = Ended(stays), Ending()
    await run(call, stream_of(ending, 5), send, ending)
    assert call.told == [Outcome.COMPLETED]


@pytest.mark.parametrize(("last", "told", "in_line"), [
    (DONE, Outcome.COMPLETED, True),
    (Failed(500, "engine_error", "the engine failed"), Outcome.FAILED, True),
    (Failed(504, "deadline_exceeded", "deadline passed"), Outcome.EXPIRED, True),
    (RedisConnectionError("gone"), Outcome.UNAVAILABLE, False),
])
async def test_the_real_stream_ends_its_call_once_by_its_last_event(last: Event | BaseException, told: Outcome,
                                                                    in_line: bool) -> None:
    """Chat's stream (`_sse`) after a first chunk: the worker's done or failure, or Redis gone
    mid-stream; the stream's documented last bytes go out and the call ends once, as they say."""
    sent: list[bytes] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg.get("body", b""))

    call, ending = Ended(stays, [Chunk(b'"delta":{"content":" there"}'), last]), Ending()
    await run(call, _sse(call, Chunk(b'"delta":{"content":"hi"}'), _Chunks("chat", "r1", "m", 0), ending),  # type: ignore[arg-type]
              send, ending)
    assert [(t, i) for t, _, i in call.ends] == [(told, in_line)]
    assert b"".join(sent).endswith(b"data: [DONE]\n\n")
    if told == Outcome.COMPLETED:
        assert call.ends[0][1] is not None and call.ends[0][1].total == 5  # settled with the engine's usage


async def test_a_whole_answer_ends_its_call_once_as_completed_with_its_usage() -> None:
    call = Ended(stays)

    async def make(_: Any, done: Done) -> Response:
        return Response(b"{}")

    got = await whole(call, DONE, make)  # type: ignore[arg-type]
    assert got.status_code == 200
    assert [(t, i) for t, _, i in call.ends] == [(Outcome.COMPLETED, True)] and call.ends[0][1].total == 5


async def test_a_whole_answer_that_cannot_be_written_still_ends_completed_once() -> None:
    """The engine made the answer (a Responses store failing to keep it is the 503 the caller
    gets): counted and charged as completed, not as the error."""
    call = Ended(stays)

    async def make(_: Any, done: Done) -> Response:
        raise APIError(503, "not kept", "service_unavailable")

    with pytest.raises(APIError):
        await whole(call, DONE, make)  # type: ignore[arg-type]
    assert call.told == [Outcome.COMPLETED]


async def test_a_whole_answer_that_came_as_a_chunk_ends_the_call_failed_once() -> None:
    call = Ended(stays)
    with pytest.raises(APIError) as e:
        await whole(call, Chunk(b'"delta":{}'))  # type: ignore[arg-type]
    assert e.value.status == 502 and [(t, i) for t, _, i in call.ends] == [(Outcome.FAILED, False)]


async def test_a_whole_answer_cancelled_while_written_still_ends_its_call() -> None:
    call = Ended(stays)
    started = asyncio.Event()

    async def make(_: Any, done: Done) -> Response:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError

    task = asyncio.ensure_future(whole(call, DONE, make))  # type: ignore[arg-type]
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert call.told == [Outcome.COMPLETED]
