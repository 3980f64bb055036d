"""Stopping background tasks for sure, even when a cancellation is lost.

A task's cancellation can be swallowed: on Python 3.11 `asyncio.wait_for` returns the result of
what it awaited when the caller is cancelled in the loop turn where that ended, and the caller
goes on as if it had never been cancelled. redis-py writes every command that way; the parts'
clients no longer do (`fleet.store.sending`), but a library can still lose one elsewhere. A loop
that awaits Redis (a heartbeat, a reaper, a listener) then runs for ever, and whoever cancels it
once and awaits it waits for ever too: a drained replica that never exits and keeps beating.
`cancel_and_wait` cancels again until the task has ended, and says when it had to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("fleet.tasks")

RECANCEL_S = 1.0  # a task still running this long after a cancel lost it: cancel it again


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None, recancel_s: float = RECANCEL_S) -> None:
    """Cancel `tasks` (None: skipped) and return once every one has ended, cancelling again,
    every `recancel_s`, any that went on. Their exceptions are retrieved, not raised."""
    mine = [t for t in tasks if t is not None]
    pending = {t for t in mine if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
        for t in pending:
            log.info("task %s still runs %.1f s after its cancel (lost in a Redis call?): cancelling it again",
                     t.get_name() if isinstance(t, asyncio.Task) else t, recancel_s)
    await asyncio.gather(*mine, return_exceptions=True)  # all done: marks their exceptions retrieved


_background: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """Run `coro` off the caller's path: the one home of a part's background work (a clean-up, a
    ring). The loop keeps only weak references to tasks, so they are held here until they end."""
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def stop_spawned() -> None:
    """At a part's shutdown: end whatever `spawn` still runs."""
    await cancel_and_wait(*_background)
