"""One listener per call for its client leaving, for the first-event race and the stream alike.

After the body is read, the ASGI server's `receive` says nothing until the client disconnects
(`http.disconnect`; also said once the response has been sent). One task reads it from the
call's start to its end: `race` gives an awaitable's result unless the client leaves first, and
a stream registers `on_gone` to be cut short when it does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fleet.outcome import CallerLeft
from fleet.tasks import cancel_and_wait

T = TypeVar("T")


class ClientGone(CallerLeft):
    """The caller disconnected (a call it ends is cancelled: `fleet.outcome.infer_outcome`)."""


class ClientWatch:
    def __init__(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self._receive = receive
        self._task: asyncio.Task[None] | None = None
        self.gone = asyncio.Event()
        self._callbacks: list[Callable[[], None]] = []

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass  # a body the client still sends is not ours to read
        self.gone.set()
        for callback in self._callbacks:
            callback()

    async def race(self, aw: Awaitable[T]) -> T:
        """`aw`'s result, or `ClientGone` if the client leaves first (then `aw` is cancelled)."""
        self._start()
        nxt = asyncio.ensure_future(aw)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (the deadline's bound): the pending read must not run on
            nxt.cancel()
            raise
        finally:
            gone.cancel()
        if nxt.done():
            return nxt.result()
        await cancel_and_wait(nxt)  # a read awaiting Redis can lose one cancel (fleet/tasks.py)
        raise ClientGone

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the client leaves (at once if it has)."""
        self._start()
        if self.gone.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    def stop(self) -> None:
        """The call has ended: stop listening (idempotent)."""
        self._callbacks.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
