"""Reading one request's result stream, racing its deadline (the client: `gateway.client_watch`)."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from fleet.outcome import Outcome
from fleet.store.events import REQUEST_LOST, Chunk, Event, Failed
from fleet.store.line import Line
from fleet.tasks import spawn
from gateway.redis_loss import GRACE_S
from gateway.result_reader import Watch

# After the deadline, how long to wait for the final event before answering without it.
GIVE_UP_AFTER_S = 5.0
DROP_AFTER_S = 0.1  # read result streams are dropped in batches gathered this long
LOST_CHECK_S = 1.0  # a call waiting this long is looked for in Redis (then again each this long)
LOST_BATCH = 1000  # requests looked for in one script call


EXPIRED = Failed(504, "deadline_exceeded", "deadline passed before the request finished")
RESULT_LOST = Failed(504, "deadline_exceeded", "deadline passed and the request's result was lost")


async def events(watch: Watch, line: Line, deadline_at: float, *, drop: bool = True) -> AsyncIterator[Event]:
    """Yield the request's events until its final one (done or failed), as the
    process's result reader (`gateway.result_reader`) hands them to `watch`.

    A call whose request vanished from Redis (a failover, a flush) gets a 503
    `request_lost` within about `LOST_CHECK_S` (see `_Lost`).

    When the gateway's own clock passes the deadline, the request is ended
    as expired (whatever state it is in: in the line it leaves, running it is
    aborted in its engine) and the 504 event that `finish` writes is read
    like any other. If a worker finished first, its event wins.

    `drop` False: the result stream is left to whoever ends the call (one its SDK may retry is
    kept for the retry, `gateway.retry_join`), not dropped once read.
    """
    rid = watch.rid
    expired_sent = False
    loop = asyncio.get_running_loop()
    lost_check(line).add(watch)  # it joined the line: from now on its request must be in Redis
    try:
        while True:
            left = deadline_at - loop.time()
            if left <= 0 and not expired_sent:
                expired_sent = True
                async with asyncio.timeout(GRACE_S):  # a frozen Redis must not hold the caller's answer
                    await line.finish(rid, Outcome.EXPIRED, EXPIRED)
            if left < -GIVE_UP_AFTER_S:
                # The final event never came (the request's keys are gone: an evicting
                # or restarted Redis). The caller still gets its answer, not a hang.
                yield RESULT_LOST
                return
            ev = await watch.next(left if left > 0 else GIVE_UP_AFTER_S + left + 0.001)
            if ev is None:
                continue
            yield ev
            if not isinstance(ev, Chunk):
                return
    finally:
        watch.close()
        lost_check(line).discard(watch)
        if drop:  # read, so drop it rather than wait for its TTL: off the caller's path, with others ended meanwhile
            drop_soon(line, rid)


async def close_events(stream: AsyncIterator[Event]) -> None:
    """Close a request's event reader off the caller's path; a reader already gone is fine."""
    with contextlib.suppress(Exception):
        await stream.aclose()  # type: ignore[attr-defined]


class _Lost:
    """One tier's calls waiting on their result, looked for in Redis every `LOST_CHECK_S`.

    A failover can lose what the old master had not yet replicated, and a flushed Redis loses
    everything; the result stream of such a call stays silent, and its caller would wait for its
    deadline. So the calls that have waited at least a check are looked for, all in one script
    call a tier (`Line.missing`), and one whose request is gone is told at once with a typed 503
    `request_lost`. A Redis that does not answer is no news here: its callers hear of it their
    own way (the reader's error, a 503 `redis_unavailable`)."""

    def __init__(self, line: Line) -> None:
        self.line = line
        self.since: dict[Watch, float] = {}  # each call, and when it joined the line (loop time)
        self.task: asyncio.Task[None] | None = None

    def add(self, watch: Watch) -> None:
        self.since[watch] = asyncio.get_running_loop().time()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name=f"lost-{self.line.tier}")

    def discard(self, watch: Watch) -> None:
        self.since.pop(watch, None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.since:
            await asyncio.sleep(LOST_CHECK_S)
            due = [w for w, t in self.since.items() if loop.time() - t >= LOST_CHECK_S]
            for at in range(0, len(due), LOST_BATCH):
                batch = due[at:at + LOST_BATCH]
                try:
                    async with asyncio.timeout(GRACE_S):
                        gone = set(await self.line.missing([w.rid for w in batch]))
                except (RedisError, TimeoutError):
                    break
                for w in batch:
                    if w.rid in gone and self.since.pop(w, None) is not None:
                        w.push(REQUEST_LOST)


_lost: weakref.WeakKeyDictionary[Line, _Lost] = weakref.WeakKeyDictionary()


def lost_check(line: Line) -> _Lost:
    """The lost-request check of `line`'s calls in this process (made on first use)."""
    got = _lost.get(line)
    if got is None:
        got = _lost[line] = _Lost(line)
    return got


class _Drops:
    """One tier's read result streams, dropped together: the calls that end within `DROP_AFTER_S`
    cost one UNLINK, not one each (a Redis error leaves them to their TTL, as it would one)."""

    def __init__(self, line: Line) -> None:
        self.line = line
        self.rids: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    def add(self, rid: str) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # a batch left on a loop that ended never flushes: start afresh
            self.rids, self.loop = [], loop
        self.rids.append(rid)
        if len(self.rids) == 1:
            loop.call_later(DROP_AFTER_S, self._flush)

    def _flush(self) -> None:
        rids, self.rids = self.rids, []
        spawn(_drop(self.line, rids))


_drops: weakref.WeakKeyDictionary[Line, _Drops] = weakref.WeakKeyDictionary()


def drop_soon(line: Line, rid: str) -> None:
    """Drop a read result stream within `DROP_AFTER_S`, with the others read meanwhile."""
    drops = _drops.get(line)
    if drops is None:
        drops = _drops[line] = _Drops(line)
    drops.add(rid)


async def _drop(line: Line, rids: list[str]) -> None:
    with contextlib.suppress(Exception):  # Redis away: the streams' TTL drops them instead
        await line.drop_events(*rids)
