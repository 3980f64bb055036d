"""The gateway's one result reader on a real Redis: every open call gets its own events, in
order; a call that starts watching while the read is blocked is not kept waiting for the
block; connections stay bounded however many calls are open; a deadline wait ends on time."""

from __future__ import annotations

import time
import uuid

import orjson
import pytest
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.store.connection import connect
from fleet.store.events import Chunk, Done, chunk_fields, encode
from fleet.store.line import Line
from gateway.result_reader import ResultReader
from tests.harness import blocked_in


@pytest.fixture
async def setup(redis_url: str):
    name = f"rr{uuid.uuid4().hex[:8]}"
    calls = connect(redis_url, "calls", max_connections=4, wait_for_connection_s=5, name=f"{name}:calls")
    blocking = connect(redis_url, "blocking", max_connections=2, wait_for_connection_s=5, name=f"{name}:blocking")
    line = Line(calls, name, "routing", result_ttl_s=30, rate_window_s=5, blocking=blocking)
    reader = ResultReader()
    yield line, reader, calls, name
    await reader.stop()
    await calls.aclose()
    await blocking.aclose()


async def write(r: Redis, line: Line, rid: str, *events: Done | str) -> None:
    """Entries as a worker writes them: a chunk of text, or an end."""
    for ev in events:
        fields = chunk_fields(orjson.dumps(ev)) if isinstance(ev, str) else dict([encode(ev)])
        await r.xadd(line.keys.result(rid), fields)  # type: ignore[arg-type]


def done(text: str) -> Done:
    return Done(1, "stop", {}, replica=text)


def seen(ev: object) -> str:
    return orjson.loads(ev.body) if isinstance(ev, Chunk) else ev.replica  # type: ignore[union-attr]


async def connections(r: Redis, name: str) -> int:
    clients = await r.client_list()
    return sum(1 for c in clients if str(c.get("name", "")).startswith(name))


async def test_many_open_calls_share_one_blocking_connection(setup, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    line, reader, _, name = setup
    rids = [uuid.uuid4().hex for _ in range(300)]
    watches = [reader.watch(line, rid) for rid in rids]
    assert reader.open_calls == 300
    writer = Redis.from_url(redis_url)
    try:
        for i, rid in enumerate(rids):  # out of order across calls, in order within one
            await write(writer, line, rid, f"{i}a", f"{i}b")
        for i, rid in enumerate(reversed(rids)):
            await write(writer, line, rid, done(str(len(rids) - 1 - i)))
        for i, w in enumerate(watches):
            got = [await w.next(10.0) for _ in range(3)]
            assert [seen(e) for e in got] == [f"{i}a", f"{i}b", str(i)]
            w.close()
        assert reader.open_calls == 0
        # 300 calls were open: one blocking connection read for all of them.
        assert await connections(writer, f"{name}:blocking") <= 2
        assert await connections(writer, f"{name}:calls") <= 4
    finally:
        await writer.aclose()


async def test_a_call_that_joins_during_a_blocked_read_is_not_kept_waiting(setup, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    line, reader, _, name = setup
    first = reader.watch(line, uuid.uuid4().hex)  # the reader now blocks (up to 5 s) on this one
    writer = Redis.from_url(redis_url)
    try:
        for _ in range(5):
            # The XREAD is sent and blocked (Redis says so): a late call is not simply taken up by
            # a read that had yet to start, which would pass the check below on a slow machine.
            await blocked_in(writer, f"{name}:blocking", "xread")
            rid = uuid.uuid4().hex
            late = reader.watch(line, rid)
            await write(writer, line, rid, done("late"))
            t0 = time.monotonic()
            ev = await late.next(4.0)
            assert ev == done("late")
            assert time.monotonic() - t0 < 2.0  # rung awake: not the 5 s block
            late.close()
        assert await first.next(0.01) is None  # nothing for it, and it waited no longer than asked
    finally:
        first.close()
        await writer.aclose()


async def test_a_wait_ends_at_its_timeout(setup) -> None:  # type: ignore[no-untyped-def]
    line, reader, _, _ = setup
    w = reader.watch(line, uuid.uuid4().hex)
    t0 = time.monotonic()
    assert await w.next(0.3) is None
    assert 0.25 <= time.monotonic() - t0 < 2.0
    w.close()


async def test_a_call_joining_during_a_blocked_read_is_rung_by_its_own_enqueue(setup, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    line, reader, _, name = setup
    first = reader.watch(line, uuid.uuid4().hex)  # the reader now blocks (up to 5 s) on this one
    writer = Redis.from_url(redis_url)
    try:
        for _ in range(3):
            await blocked_in(writer, f"{name}:blocking", "xread")
            rid = uuid.uuid4().hex
            late = reader.watch(line, rid, ring=False)
            assert late.wake is not None  # this call's enqueue is to ring the read in flight
            also = reader.watch(line, uuid.uuid4().hex, ring=False)
            assert also.wake is None  # one ring a read: the first joiner's
            rung = await writer.xrevrange(late.wake, count=1)
            await line.enqueue(rid, Priority.interactive, b"{}", 60_000, wake=late.wake)
            # The ring went inside the enqueue's script (the reader's wake stream has a new entry).
            assert (await writer.xrevrange(late.wake, count=1)) != rung
            await write(writer, line, rid, done("late"))
            t0 = time.monotonic()
            assert await late.next(4.0) == done("late")
            assert time.monotonic() - t0 < 2.0  # rung awake by the enqueue: not the 5 s block
            late.close()
            also.close()
    finally:
        first.close()
        await writer.aclose()


async def test_a_ring_left_to_an_enqueue_that_failed_is_rung_apart(setup, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    line, reader, _, name = setup
    first = reader.watch(line, uuid.uuid4().hex)
    writer = Redis.from_url(redis_url)
    try:
        await blocked_in(writer, f"{name}:blocking", "xread")
        failed = reader.watch(line, uuid.uuid4().hex, ring=False)
        rid = uuid.uuid4().hex
        other = reader.watch(line, rid, ring=False)  # relies on the first joiner's ring
        failed.ring_apart()  # its enqueue raised: the ring goes out on its own
        failed.close()
        await write(writer, line, rid, done("other"))
        t0 = time.monotonic()
        assert await other.next(4.0) == done("other")
        assert time.monotonic() - t0 < 2.0
        other.close()
    finally:
        first.close()
        await writer.aclose()
