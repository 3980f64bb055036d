"""One reader of result streams per gateway process: many open calls, one blocking connection per tier.

A call used to wait on its own result stream with its own blocking XREAD, so every
open call held a Redis connection (and a pool of 4096 capped a gateway at that many
open calls). Here one task per tier issues a single XREAD BLOCK over the result
streams of all that tier's open calls and hands each entry to its call's `Watch`.
Per tier, not across tiers: a tier's keys share one hash tag, so one XREAD touches
one slot and still runs on Redis Cluster.

A call that starts watching while that XREAD is blocked is not in it yet. So the
tier's wake stream is rung (one XADD, several new calls in one go share it): the XREAD
returns and the next one includes the new stream, read from its start, so nothing
written meanwhile is missed. The wake stream is this process's own key (`res:~gw-<id>`,
trimmed to one entry, with the result TTL). A call about to join the line rings it in
its enqueue's own script (`Watch.wake`, `Line.enqueue(wake=...)`): its result cannot come
before it joins, and the gateway saves a round trip a call.

A read costs the gateway and Redis time in proportion to the streams it names, however
few have news. So with many calls open the reader paces itself: the next read starts no
sooner than `PACE_PER_CALL_S` per open call after the last one began (5 ms at 5,000 open
calls, nothing noticeable below a few hundred), and what arrived meanwhile comes in one
read. An event waits at most one pace.

Redis connections per gateway: one blocking connection per tier for the readers,
plus the bounded pool of ordinary calls, whatever the number of open calls. A
Redis error in the read fails the calls that were waiting (as their own XREAD
failing did); later calls read again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque

from redis.exceptions import RedisError

from fleet.store.connection import MAX_BLOCK_S
from fleet.store.events import Chunk, Event
from fleet.store.line import Line
from fleet.tasks import cancel_and_wait, spawn

log = logging.getLogger(__name__)

COUNT = 256  # entries per stream per read: a burst of tokens arrives in one read
PACE_PER_CALL_S = 1e-6  # the least time between two reads, per open call (see above)
_BLOCK_MS = int(MAX_BLOCK_S * 1000)  # a read ends by this at the latest (a ring ends it sooner)
_RETRY_AFTER_ERROR_S = 0.1


class Watch:
    """One call's view of its result stream: `await next(timeout)` gives its events in order."""

    __slots__ = ("_ready", "_tier", "error", "events", "key", "last", "rid", "wake")

    def __init__(self, tier: _Tier, rid: str, key: bytes) -> None:
        self._tier = tier
        self.rid = rid
        self.key = key
        self.last = b"0-0"  # the last entry read: the next read starts after it
        self.events: deque[Event] = deque()
        self.error: BaseException | None = None
        self._ready: asyncio.Future[None] | None = None  # set while the call waits
        # The reader's wake stream, when this call's enqueue is to ring it (`watch(..., ring=False)`).
        self.wake: bytes | None = None

    async def next(self, timeout_s: float) -> Event | None:
        """The next event, or None when `timeout_s` passes first. Raises the reader's Redis error."""
        if not self.events and self.error is None:
            loop = asyncio.get_running_loop()
            self._ready = ready = loop.create_future()
            # A plain timer rather than asyncio.timeout: this runs for every event of every call.
            timer = loop.call_later(max(0.0, timeout_s), _settle, ready)
            try:
                await ready
            finally:
                timer.cancel()
                self._ready = None
        if self.events:
            return self.events.popleft()
        if self.error is not None:
            raise self.error
        return None  # the timeout passed

    def push(self, ev: Event) -> None:
        """Hand the call an event that did not come from its stream (`gateway.results`: its request was lost)."""
        self.events.append(ev)
        self._wake()

    def close(self) -> None:
        """Stop watching (the call ended); idempotent."""
        self._tier.watches.pop(self.key, None)

    def ring_apart(self) -> None:
        """The enqueue that was to ring the reader did not run: ring it with a command of its own,
        so the other calls that joined this read are not left to its block's end."""
        if self.wake is not None:
            self.wake = None
            spawn(self._tier._ring())

    def _wake(self) -> None:
        if self._ready is not None:
            _settle(self._ready)


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class _Tier:
    """The open calls of one tier and the one task reading their streams."""

    def __init__(self, reader: ResultReader, line: Line) -> None:
        self.reader = reader
        self.line = line
        self.watches: dict[bytes, Watch] = {}
        self.wake_key = line.reader_wake_key(reader.id)
        self.wake_last = b"0-0"
        self.reading = False  # an XREAD is in flight: a new watch must ring the wake stream
        self.rung = False  # ... and has done so for this XREAD
        self.task: asyncio.Task[None] | None = None

    def watch(self, rid: str, ring: bool) -> Watch:
        w = Watch(self, rid, self.line.keys.result(rid).encode())
        self.watches[w.key] = w
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name=f"results-{self.line.tier}")
        elif self.reading and not self.rung:
            self.rung = True
            if ring:
                spawn(self._ring())
            else:
                w.wake = self.wake_key
        return w

    async def _ring(self) -> None:
        try:
            await self.line.ring_reader(self.wake_key)
        except RedisError as e:  # the read still ends at its block; the new call waits that long
            log.warning("ringing the result reader of %s failed: %s", self.line.tier, e)

    async def _run(self) -> None:
        """Read every watched stream in one XREAD until no call is watching."""
        loop = asyncio.get_running_loop()
        while self.watches:
            keys = [self.wake_key, *self.watches]
            ids = [self.wake_last, *(w.last for w in self.watches.values())]
            self.reading, self.rung = True, False
            began = loop.time()
            try:
                news = await self.line.read_results(keys, ids, _BLOCK_MS, COUNT)
            except Exception as e:  # Redis away, or an entry that is no event: never a reader that dies
                if not isinstance(e, RedisError):
                    log.exception("reading the result streams of %s failed", self.line.tier)
                self._fail(e)
                await asyncio.sleep(_RETRY_AFTER_ERROR_S)
                continue
            finally:
                self.reading = False
            for key, last, events in news:
                w = self.watches.get(key)
                if w is None:
                    if key == self.wake_key:
                        self.wake_last = last
                    continue  # a call that ended meanwhile
                w.last = last
                w.events.extend(events)
                if events and not isinstance(events[-1], Chunk):
                    # Nothing follows a final event: stop reading its stream now, so the next
                    # read does not name it (and with no other call open, none is issued at all:
                    # the next call starts a fresh read instead of ringing this one awake).
                    del self.watches[key]
                w._wake()
            pause = len(self.watches) * PACE_PER_CALL_S - (loop.time() - began)
            if pause > 0.0005:
                await asyncio.sleep(pause)
            elif news:
                # The calls just woken answer their callers first; the next read (a send) waits one turn.
                await asyncio.sleep(0)

    def _fail(self, e: BaseException) -> None:
        """The calls waiting when the read failed get its error; they end (503 or an error event)."""
        for w in list(self.watches.values()):
            w.error = e
            w._wake()
        self.watches.clear()


class ResultReader:
    """The gateway's result reader: `watch(line, rid)` for each call, before it joins the line.
    Each tier's reads go through its `Line` on the line's blocking client."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:12]
        self._tiers: dict[str, _Tier] = {}

    def watch(self, line: Line, rid: str, *, ring: bool = True) -> Watch:
        """Watch `rid`'s result stream. `ring` False: a read in flight that must be rung to take it in
        is left to the call's enqueue (`Watch.wake`; `Watch.ring_apart` if the enqueue fails)."""
        tier = self._tiers.get(line.tier)
        if tier is None:
            tier = self._tiers[line.tier] = _Tier(self, line)
        return tier.watch(rid, ring)

    @property
    def open_calls(self) -> int:
        return sum(len(t.watches) for t in self._tiers.values())

    async def stop(self) -> None:
        tasks = [t.task for t in self._tiers.values() if t.task is not None]
        await cancel_and_wait(*tasks)  # not a lone cancel(): one lost in a Redis call hangs the exit
