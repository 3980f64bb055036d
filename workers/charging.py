"""A replica's token charges, sent to the ledger together at the stream writer's pace.

Each ended attempt is charged its tokens (and, with them, its version's outcome): one
pipeline round trip each, when calls end one at a time. A busy replica ends many calls a
second, and each round trip costs the worker a socket write and read and, under redis-py
with a socket timeout on Python 3.11, a task of its own. So the charges of the calls that
end within one window (`stream_window_ms`) go in one pipeline (`Ledger.record_many`): the
first at once, those that come while it is in flight or within the window after it, next.
A charge waits at most one window plus one round trip; `stop` sends what is left.
"""

from __future__ import annotations

import asyncio
import logging

from fleet.store.ledger import Ledger, TokenCharge

log = logging.getLogger("fleet.worker")


class Charges:
    """`add` each ended attempt's charge; `await stop()` before the replica exits."""

    def __init__(self, ledger: Ledger, window_s: float) -> None:
        self.ledger = ledger
        self.window_s = window_s
        self._batch: list[TokenCharge] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, charge: TokenCharge) -> None:
        self._batch.append(charge)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._send_loop(), name="token-charges")

    async def _send_loop(self) -> None:
        while self._batch:
            batch, self._batch = self._batch, []
            try:
                await self.ledger.record_many(batch)
            except Exception as e:  # Redis away: those charges are lost, as a lone charge's would be
                log.warning("charging %d ended calls failed: %s", len(batch), e)
            if self.window_s > 0:  # what ends meanwhile rides in the next round trip
                await asyncio.sleep(self.window_s)

    async def stop(self) -> None:
        """Send what is waiting (the replica is exiting): nothing charged is left behind."""
        while self._task is not None and not self._task.done():
            await self._task
