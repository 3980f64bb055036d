"""A streamed answer owns its call's end (`gateway.answers.SSEResponse`): the call ends exactly once
however the stream stops, the client gone before the first byte included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from gateway.answers import SSEResponse
from gateway.client_watch import ClientWatch


class Ended:
    """What of a `Call` the response touches: its headers, its client watch, and `end` (once)."""

    def __init__(self, receive: Any) -> None:
        self.headers: dict[str, str] = {}
        self.client = ClientWatch(receive)
        self.told: list[str] = []

    async def end(self, told: str, usage: object = None, *, in_line: bool = False) -> None:
        if not self.told:
            self.told.append(told)


def stream_of(call: Ended, n: int) -> AsyncGenerator[bytes, None]:
    async def gen() -> AsyncGenerator[bytes, None]:
        told = "cancelled"
        try:
            for i in range(n):
                yield b"data: %d\n\n" % i
            told = "completed"
        finally:
            await call.end(told)

    return gen()


async def run(call: Ended, body: AsyncGenerator[bytes, None], send: Any) -> None:
    await SSEResponse(body, call)({"type": "http"}, call.client._receive, send)  # type: ignore[arg-type]


async def test_a_client_gone_before_the_first_byte_still_ends_the_call() -> None:
    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(_: dict[str, Any]) -> None:
        await asyncio.sleep(0)  # a server's send that yields once: the watcher cancels the stream here

    call = Ended(receive)
    await run(call, stream_of(call, 5), send)
    assert call.told == ["cancelled"]


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

    call = Ended(receive)
    await run(call, stream_of(call, 1000), send)
    assert call.told == ["cancelled"] and len(sent) < 100


async def test_a_stream_that_finishes_ends_the_call_as_it_says() -> None:
    async def receive() -> dict[str, str]:
        await asyncio.Event().wait()  # the client stays
        return {}

    async def send(_: dict[str, Any]) -> None:
        return None

    call = Ended(receive)
    await run(call, stream_of(call, 5), send)
    assert call.told == ["completed"]
