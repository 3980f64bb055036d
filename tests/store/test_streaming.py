"""The replica's stream writer on a real Redis: every token arrives once, in order, before the
final event; the first token is not held back; many streams share few round trips; an attempt
whose lease is gone writes nothing."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest

from fleet.config import Priority
from fleet.store.events import Done, decode
from fleet.store.line import Claimed, Line
from tests.store.conftest import LineSpec
from workers.engines.base import Delta
from workers.streaming import LeaseLost, StreamWriter

DONE = Done(1, "stop", {})


class CountingLine(Line):
    """A Line that counts its round trips for streamed text."""

    writes = 0

    async def emit(self, tokens):  # type: ignore[no-untyped-def]
        self.writes += 1
        return await super().emit(tokens)


@pytest.fixture
def line_spec() -> LineSpec:
    """The shared `line` (tests/store/conftest.py), counting its stream writes."""
    return LineSpec(CountingLine)


async def running(line: Line, n: int = 1, lease_s: float = 5) -> list[Claimed]:
    """n requests claimed by replica `w`: streams can only be written while a lease is held."""
    for _ in range(n):
        await line.enqueue(uuid.uuid4().hex, Priority.interactive, orjson.dumps({}), 30_000)
    return await line.claim("w", n, lease_s)


async def until(read, want, limit_s: float = 10.0):  # type: ignore[no-untyped-def]
    """Await `read()` until it returns `want` (a condition, not a fixed sleep)."""
    got = None
    for _ in range(int(limit_s / 0.01)):
        if (got := await read()) == want:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"still {got!r}, not {want!r}, after {limit_s} s")


async def texts(line: Line, rid: str) -> list[str]:
    return [decode(f).members()["delta"]["content"] for _, f in await line.redis.xrange(line.keys.result(rid))]


async def test_many_streams_in_order_in_few_round_trips(line: CountingLine) -> None:
    w = StreamWriter(line, window_s=0.05)
    reqs = await running(line, 4)
    for c in reqs:
        w.open(c.lease, c.rid, c.owner, c.attempt)

    async def stream(c: Claimed) -> None:
        for i in range(40):  # a token every 2 ms, like a busy engine
            w.push(c.lease, Delta(f"{i} "))
            await asyncio.sleep(0.002)
        await w.close(c.lease)

    await asyncio.gather(*(stream(c) for c in reqs))
    for c in reqs:
        got = await texts(line, c.rid)
        assert "".join(got) == "".join(f"{i} " for i in range(40))
        assert got[0] == "0 "  # the first token went out alone, at once
        assert await line.redis.hget(line.keys.request(c.rid), "streamed") == b"1"
        w.discard(c.lease)
    # 160 tokens; a write per token would be 160 round trips.
    assert line.writes < 40
    await w.stop()


async def test_one_stream_is_paced_too_first_token_at_once(line: CountingLine) -> None:
    """A replica streaming to one caller batches by the same pace as a busy one: the first token
    goes out alone and at once, what follows within the window shares one chunk."""
    w = StreamWriter(line, window_s=2.0)
    [c] = await running(line)
    w.open(c.lease, c.rid, c.owner, c.attempt)
    w.push(c.lease, Delta("t0 "))
    await until(lambda: texts(line, c.rid), ["t0 "], limit_s=1.5)  # within the window: not held by it
    for i in range(1, 5):
        w.push(c.lease, Delta(f"t{i} "))
    await until(lambda: texts(line, c.rid), ["t0 ", "t1 t2 t3 t4 "], limit_s=10.0)
    assert line.writes == 2
    await w.stop()


async def test_no_window_writes_each_token_as_it_comes(line: CountingLine) -> None:
    """`stream_window_ms: 0`: each write goes as soon as the previous one returned."""
    w = StreamWriter(line, window_s=0)
    [c] = await running(line)
    w.open(c.lease, c.rid, c.owner, c.attempt)
    for i in range(5):
        w.push(c.lease, Delta(f"t{i} "))
        await until(lambda: texts(line, c.rid), [f"t{j} " for j in range(i + 1)], limit_s=2.0)
    await asyncio.wait_for(w.close(c.lease), 2.0)
    assert line.writes == 5
    await w.stop()


async def test_first_token_is_not_held_for_the_window(line: Line) -> None:
    w = StreamWriter(line, window_s=5.0)  # a window no test could sit out
    a, b = await running(line, 2)
    w.open(a.lease, a.rid, a.owner, a.attempt)
    w.push(a.lease, Delta("x"))  # starts a long window after its write
    await until(lambda: texts(line, a.rid), ["x"])  # written: the window runs
    w.open(b.lease, b.rid, b.owner, b.attempt)
    w.push(b.lease, Delta("y"))
    await asyncio.wait_for(w.close(b.lease), 1.0)  # b's first token (and its close) cut a's window short
    assert await texts(line, b.rid) == ["y"]
    await asyncio.wait_for(w.close(a.lease), 1.0)
    await w.stop()


async def test_a_first_token_or_a_close_cuts_no_other_streams_window(line: Line) -> None:
    """Another call starting or ending writes that call's stream alone: the text of the calls in
    mid-window keeps riding to the window's end, one chunk, not one chunk per start and end."""
    w = StreamWriter(line, window_s=0.6)
    a, b, c = await running(line, 3)
    w.open(a.lease, a.rid, a.owner, a.attempt)
    w.push(a.lease, Delta("a0 "))
    await until(lambda: texts(line, a.rid), ["a0 "])  # a's first: at once; a window starts
    w.push(a.lease, Delta("a1 "))  # in mid-window: waits for its end
    w.open(b.lease, b.rid, b.owner, b.attempt)
    w.push(b.lease, Delta("b0 "))  # b's first token: written at once ...
    await until(lambda: texts(line, b.rid), ["b0 "], limit_s=0.5)
    assert await texts(line, a.rid) == ["a0 "]  # ... alone: a's window runs on (read the moment b's is there)
    w.open(c.lease, c.rid, c.owner, c.attempt)
    w.push(c.lease, Delta("c0 "))
    await asyncio.wait_for(w.close(c.lease), 0.5)  # c starts and ends: its stream alone, again
    w.push(a.lease, Delta("a2 "))
    assert await texts(line, a.rid) == ["a0 "]
    await until(lambda: texts(line, a.rid), ["a0 ", "a1 a2 "])  # the window's end: one chunk
    await asyncio.wait_for(w.close(a.lease), 1.0)
    await asyncio.wait_for(w.close(b.lease), 1.0)
    await w.stop()


async def test_close_waits_for_the_last_token_then_the_final_event_follows(line: Line) -> None:
    [c] = await running(line)
    w = StreamWriter(line, window_s=0.2)
    w.open(c.lease, c.rid, c.owner, c.attempt)
    for t in ("a", "b", "c"):
        w.push(c.lease, Delta(t))
    await w.close(c.lease)
    assert await line.finish(c.rid, "completed", DONE, owner=c.owner)
    events = [decode(f) for _, f in await line.redis.xrange(line.keys.result(c.rid))]
    assert "".join(e.members()["delta"]["content"] for e in events[:-1]) == "abc"
    assert isinstance(events[-1], Done)
    await w.stop()


async def test_the_last_text_rides_in_the_finish_in_order_and_only_for_the_lease_holder(line: CountingLine) -> None:
    """A worker ends a streamed call in one round trip: what is still buffered goes in its finish
    (`rest` + `finish(last_chunk=...)`), after every chunk already written and before the end; a
    finish whose lease is gone writes none of it."""
    c, lost = await running(line, 2)
    w = StreamWriter(line, window_s=5.0)  # the window never passes here: only `rest` can write the tail
    w.open(c.lease, c.rid, c.owner, c.attempt, model="m1")
    w.push(c.lease, Delta("a "))
    await until(lambda: texts(line, c.rid), ["a "])  # the first text, written at once
    for t in ("b ", "c"):
        w.push(c.lease, Delta(t))
    writes = line.writes
    last, model = await asyncio.wait_for(w.rest(c.lease), 1.0)
    assert (last, model) == (b'"delta":{"content":"b c"},"logprobs":null', "")  # the model went with "a "
    assert await line.finish(c.rid, "completed", DONE, owner=c.owner, last_chunk=last, last_model=model)
    assert line.writes == writes  # no EMIT for the tail: it went with the finish
    events = [decode(f) for _, f in await line.redis.xrange(line.keys.result(c.rid))]
    assert [e.members()["delta"]["content"] for e in events[:-1]] == ["a ", "b c"] and isinstance(events[-1], Done)
    assert events[0].model == "m1"

    w.open(lost.lease, lost.rid, lost.owner, lost.attempt, model="m1")
    w.push(lost.lease, Delta("only"))  # its whole answer before its first write: the model rides along
    last, model = await w.rest(lost.lease)
    assert model == "m1" and b"only" in last
    assert await line.finish(lost.rid, "completed", DONE, owner="someone-else", last_chunk=last) is None
    assert await line.redis.xrange(line.keys.result(lost.rid)) == []  # not the lease holder: nothing written
    await w.stop()


async def test_discarded_stream_writes_nothing_more(line: Line) -> None:
    w = StreamWriter(line, window_s=0.2)
    c, other = await running(line, 2)
    w.open(c.lease, c.rid, c.owner, c.attempt)
    w.push(c.lease, Delta("first"))
    await until(lambda: texts(line, c.rid), ["first"])  # written; the window runs
    w.push(c.lease, Delta("dropped"))
    w.discard(c.lease)  # cancelled: what is buffered goes nowhere
    # Another stream's text, pushed after the discard, is written: the writer has run the
    # batch "dropped" would have ridden in, had it been kept.
    w.open(other.lease, other.rid, other.owner, other.attempt)
    w.push(other.lease, Delta("later"))
    await w.close(other.lease)
    assert await texts(line, other.rid) == ["later"]
    assert await texts(line, c.rid) == ["first"]
    await w.stop()


async def test_an_attempt_whose_lease_was_reaped_writes_nothing(line: Line) -> None:
    """A replica that stalled past its lease must not stream into the request's next attempt."""
    [old] = await running(line, lease_s=0.05)
    assert await until(line.reap, (1, 0, 0))  # its lease ran out: back in the line, not streamed yet
    [new] = await line.claim("w", 1, 5)  # the same replica gets it again: attempt 2
    assert new.rid == old.rid and new.attempt == 2 and new.owner != old.owner
    w = StreamWriter(line, window_s=0)
    w.open(old.lease, old.rid, old.owner, old.attempt)
    w.open(new.lease, new.rid, new.owner, new.attempt)
    w.push(old.lease, Delta("stale "))
    with pytest.raises(LeaseLost):
        await w.close(old.lease)
    w.push(new.lease, Delta("fresh"))
    await w.close(new.lease)
    assert await texts(line, new.rid) == ["fresh"]
    # Nor can the old attempt renew or finish what the new one runs.
    assert await line.renew([(old.rid, old.owner)], 5) == [old.rid]
    assert not await line.finish(old.rid, "completed", DONE, owner=old.owner)
    assert await line.finish(new.rid, "completed", DONE, owner=new.owner) == "running"
    await w.stop()
