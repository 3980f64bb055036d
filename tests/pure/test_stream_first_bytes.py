"""A stream's first bytes go out on the call's own task (`gateway.answers.SSEResponse`): a client
that leaves ends the stream with its generator's clean-up and is no cancel of the task; a stream
runs to its end, and a cancel from outside still cancels it. No Redis: the response runs over a
generator of chunks and a stand-in for the ASGI channel."""

from __future__ import annotations

import asyncio

import pytest

from gateway.answers import SSEResponse
from gateway.client_watch import ClientWatch


async def _respond(gen_blocks: bool, leave_after_first: bool, first_out: asyncio.Event | None = None
                   ) -> tuple[list[dict[str, object]], list[str]]:
    """Run an SSEResponse over a generator of two chunks (or one, then a wait for ever); the client
    leaves after the first chunk if asked. Returns what was sent and what the generator saw;
    `first_out` is set once the first chunk has gone out."""
    seen: list[str] = []
    first_out = first_out or asyncio.Event()
    leave = asyncio.Event()

    async def gen():  # type: ignore[no-untyped-def]
        try:
            yield b"data: 1\n\n"
            first_out.set()
            if gen_blocks:
                await asyncio.Event().wait()
            yield b"data: 2\n\n"
        finally:
            seen.append("clean-up")

    sent: list[dict[str, object]] = []

    async def send(m: dict[str, object]) -> None:
        sent.append(m)

    async def receive() -> dict[str, str]:
        if leave_after_first:
            await first_out.wait()
        else:
            await leave.wait()  # never: the response ends first
        return {"type": "http.disconnect"}

    client = ClientWatch(receive)  # the call's one watcher of its client, as the gateway hands it over
    call = _Call(client)
    try:
        await SSEResponse(gen(), call)({"type": "http"}, receive, send)  # type: ignore[arg-type]
    finally:
        client.stop()
    assert len(call.told) == 1, call.told  # the response ended its call once, however it stopped
    return sent, seen


class _Call:
    """What of a `Call` the response reads (its headers, its client's watcher) and ends."""

    def __init__(self, client: ClientWatch) -> None:
        self.headers: dict[str, str] = {}
        self.client = client
        self.told: list[str] = []

    async def end(self, told: str, *_: object, **__: object) -> None:
        self.told.append(told)


async def test_a_stream_whose_client_leaves_ends_with_its_clean_up() -> None:
    sent, seen = await _respond(gen_blocks=True, leave_after_first=True)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"data: 1\n\n" and seen == ["clean-up"]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # the client's leaving is no cancel


async def test_a_stream_runs_to_its_end_and_a_cancel_from_outside_still_cancels() -> None:
    sent, seen = await _respond(gen_blocks=False, leave_after_first=False)
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n", b"data: 2\n\n", b""] and seen == ["clean-up"]
    first = asyncio.Event()
    task = asyncio.ensure_future(_respond(gen_blocks=True, leave_after_first=False, first_out=first))
    await asyncio.wait_for(first.wait(), 5)  # streaming, the generator waiting
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
