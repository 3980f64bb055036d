"""The streamed tokens of every request on a replica, written to their result streams together.

A write per token costs the fleet a Redis round trip in the worker (on loopback TCP the
send alone is ~0.2 ms of the worker's CPU), a stream entry, an SSE chunk in the gateway
and a parse in the client: on a small box that is CPU the engine itself needs (see
bench/engine_passthrough.py and docs/token-relay-profile.md). So one writer per replica
gathers the text of all its streams and writes it in one round trip.

The writer keeps a replica-wide pace: after each whole write it lets `window_s` pass
(`stream_window_ms`, 20 ms by default) before the next, so however many calls are open,
one round trip carries every token that came meanwhile, of every stream. Two things do not
wait for the window: a request's first text (its caller's time to first token is never held)
and a request's close (its last tokens go out at once, then its final event). Those streams
alone are written at once, and the others keep their window: on a replica where calls start
and end every few milliseconds, cutting every stream's window at each start or end would make
every chunk a few milliseconds of tokens (6 tokens a chunk at 10 open calls of 128 tokens,
where the window holds 20), and each chunk costs the worker, Redis, the gateway and the client
the same whatever it carries. A token waits at most one window plus one write; `window_s` 0
writes as fast as Redis takes them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson

from fleet.chat_shapes import merge_delta, merge_logprobs
from fleet.store.line import Line
from fleet.tasks import cancel_and_wait
from workers.engines.base import Delta

WINDOW_S = 0.02  # 20 ms: below what a reader notices, a few decode steps of a busy engine


class LeaseLost(Exception):
    """The request's lease moved on (reaped, requeued): this attempt must stop."""


@dataclass(slots=True)
class _Stream:
    """One attempt's stream: what is buffered for its next chunk.

    Plain text (the common case) is buffered as strings and written without a dict. A delta
    with more than text (a tool-call fragment, reasoning, logprobs) turns the buffer into one
    merged delta (`fleet.chat_shapes.merge_delta`): a burst of fragments is one chunk, as a
    client would have merged it anyway."""

    rid: str
    owner: str
    attempt: int
    chat: bool = True
    model: str = ""  # the engine's model name, sent with the first chunk
    buf: list[str] = field(default_factory=list)
    delta: dict[str, Any] | None = None  # the merged delta, once a delta brought more than text
    logprobs: dict[str, Any] | None = None
    sent_any: bool = False  # its first token is written: the request is marked streamed
    closing: bool = False  # its caller waits in `close`: its last tokens go at once
    landed: asyncio.Event = field(default_factory=asyncio.Event)  # set when none of its text is in flight
    written: asyncio.Event = field(default_factory=asyncio.Event)  # set when nothing is buffered or in flight
    error: BaseException | None = None

    @property
    def pending(self) -> bool:
        return bool(self.buf) or self.delta is not None or self.logprobs is not None

    @property
    def urgent(self) -> bool:
        """Written without waiting for the window: its first text, or its last before the close."""
        return not self.sent_any or self.closing

    def add(self, d: Delta) -> None:
        if d.fields is None and d.logprobs is None and self.delta is None and self.logprobs is None:
            self.buf.append(d.text)
            return
        if self.chat and (d.fields is not None or self.delta is not None):
            self.delta = merge_delta(self.delta or {}, {"content": self._text()} if self.buf else {})
            merge_delta(self.delta, {**({"content": d.text} if d.text else {}), **(d.fields or {})})
        elif d.text:
            self.buf.append(d.text)
        self.logprobs = merge_logprobs(self.logprobs, d.logprobs)

    def _text(self) -> str:
        text = "".join(self.buf)
        self.buf.clear()
        return text

    def take(self) -> bytes:
        """The buffered chunk's members as JSON without braces (`fleet.store.events`); the buffer empties."""
        logprobs = orjson.dumps(self.logprobs)
        if self.delta is not None:
            if self.buf:
                merge_delta(self.delta, {"content": self._text()})
            body = b'"delta":' + orjson.dumps(self.delta)
        else:
            body = (b'"delta":{"content":' if self.chat else b'"text":') + orjson.dumps(self._text())
            if self.chat:
                body += b"}"
        self.delta = self.logprobs = None
        return body + b',"logprobs":' + logprobs


class StreamWriter:
    """Per attempt, by its lease (`Claimed.lease`): `open`, `push` each text delta, then
    `await rest` for the text its finish writes before the final event (or `await close`
    before a final event written apart), `discard` in any case when the attempt ends. Keying by the attempt, not the
    request, keeps a stalled old attempt from touching a new one's stream."""

    def __init__(self, line: Line, window_s: float = WINDOW_S) -> None:
        self.line = line
        self.window_s = window_s
        self._streams: dict[str, _Stream] = {}
        self._more = asyncio.Event()  # something is buffered
        self._now = False  # a first token or a close: write those streams now
        self._due_at = 0.0  # when the next whole write is due (loop time): a window after the last
        self._pause: asyncio.Future[None] | None = None  # the window being let pass, if one is
        self._task: asyncio.Task[None] | None = None

    def open(self, lease: str, rid: str, owner: str, attempt: int, *, chat: bool = True, model: str = "") -> None:
        s = _Stream(rid, owner, attempt, chat, model)
        s.written.set()
        s.landed.set()
        self._streams[lease] = s
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write_loop(), name="stream-writer")

    def push(self, lease: str, delta: Delta) -> None:
        s = self._streams[lease]
        if s.error is not None:
            raise s.error  # a failed write fails its request now, not at the end
        if not s.sent_any and not s.pending:
            self._hurry()
        s.add(delta)
        s.written.clear()
        self._more.set()

    async def close(self, lease: str) -> None:
        """Returns once every token pushed for this attempt is in its result stream."""
        s = self._streams[lease]
        if not s.written.is_set():
            s.closing = True
            self._hurry()
            await s.written.wait()
        if s.error is not None:
            raise s.error

    async def rest(self, lease: str) -> tuple[bytes, str]:
        """Take what is buffered for this attempt and not yet written, for its finish to write
        (`Line.finish(last_chunk=...)`): (the chunk's members, or b"" for none; the engine's model
        name if no chunk has carried it yet). A write of its text in flight lands first, so the
        chunks stay in order. Ending a call this way saves the worker a round trip a call, and the
        caller the wait for it."""
        s = self._streams[lease]
        while not s.landed.is_set():
            await s.landed.wait()
        if s.error is not None:
            raise s.error
        if not s.pending:
            return b"", ""
        model = "" if s.sent_any else s.model
        body = s.take()
        s.sent_any = True
        s.written.set()
        return body, model

    def discard(self, lease: str) -> None:
        """Forget the attempt; text still buffered for it is dropped (it was cancelled or failed)."""
        self._streams.pop(lease, None)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)  # its writes go to Redis, where a cancel can be lost

    def _hurry(self) -> None:
        """Write the urgent streams at once: now if a window is being let pass, else right after
        the write in flight."""
        self._now = True
        if self._pause is not None and not self._pause.done():
            self._pause.set_result(None)

    async def _let_window_pass(self) -> None:
        """Wait until the next whole write is due unless hurried. A plain timer and a future, not
        asyncio.wait_for, which on Python 3.11 starts a task per wait."""
        loop = asyncio.get_running_loop()
        left = self._due_at - loop.time()
        if self._now or left <= 0:
            return
        self._pause = pause = loop.create_future()
        timer = loop.call_later(left, _settle, pause)
        try:
            await pause
        finally:
            timer.cancel()
            self._pause = None

    async def _write_loop(self) -> None:
        """When the window has passed, write every stream's buffered text in one round trip;
        before it, only the urgent streams' (a first text, a close). Then let the rest of the
        window pass (cut short by the next urgent one). A lost lease or a Redis error fails its
        streams."""
        loop = asyncio.get_running_loop()
        while True:
            await self._more.wait()
            self._more.clear()
            self._now = False
            whole = loop.time() >= self._due_at
            batch = [(s, s.take()) for s in self._streams.values() if s.pending and (whole or s.urgent)]
            if batch:
                await self._write(batch)
            if whole:
                self._due_at = loop.time() + self.window_s  # the pace: what comes meanwhile rides in the next
            if any(s.pending for s in self._streams.values()):
                self._more.set()  # left for the window's end (or came during the write)
            await self._let_window_pass()

    async def _write(self, batch: list[tuple[_Stream, bytes]]) -> None:
        """One EMIT round trip for `batch`; a stream whose lease is gone, or all of them on a Redis
        error, keep the error for their next push, close or rest."""
        for s, _ in batch:
            s.landed.clear()
        try:
            lost = set(await self.line.emit([(s.rid, s.owner, body, not s.sent_any,
                                               "" if s.sent_any else s.model) for s, body in batch]))
            for i, (s, _) in enumerate(batch):
                if i in lost:
                    s.error = LeaseLost(f"lease on {s.rid} attempt {s.attempt} is gone")
        except Exception as e:  # a Redis blip fails these requests, not the replica
            for s, _ in batch:
                s.error = e
        for s, _ in batch:
            s.sent_any = True
            s.landed.set()
            if not s.pending:
                s.written.set()


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
