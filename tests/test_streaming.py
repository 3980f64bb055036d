"""The replica's stream writer on a real Redis: every token arrives once, in order, before the
final event; the first token is not held back; many streams share few round trips."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.line import Line
from workers.streaming import StreamWriter


class CountingLine(Line):
    """A Line that counts its round trips for streamed text."""

    writes = 0

    async def emit_many(self, events):  # type: ignore[no-untyped-def]
        self.writes += 1
        await super().emit_many(events)


@pytest.fixture
async def line(redis_url: str):
    r = Redis.from_url(redis_url)
    yield CountingLine(r, f"t{uuid.uuid4().hex[:8]}", "routing", result_ttl_s=30, rate_window_s=5)
    await r.aclose()


async def texts(line: Line, rid: str) -> list[str]:
    return [orjson.loads(f[b"e"])["x"] for _, f in await line.redis.xrange(line.keys.result(rid))]


async def test_many_streams_in_order_in_few_round_trips(line: CountingLine) -> None:
    counting = line
    w = StreamWriter(counting, window_s=0.05)
    rids = [uuid.uuid4().hex for _ in range(4)]
    for rid in rids:
        w.open(rid, 1)

    async def decode(rid: str) -> None:
        for i in range(40):  # a token every 2 ms, like a busy engine
            w.push(rid, f"{i} ")
            await asyncio.sleep(0.002)
        await w.close(rid)

    await asyncio.gather(*(decode(rid) for rid in rids))
    for rid in rids:
        got = await texts(counting, rid)
        assert "".join(got) == "".join(f"{i} " for i in range(40))
        assert got[0] == "0 "  # the first token went out alone, at once
        assert await counting.redis.hget(counting.keys.request(rid), "streamed") == b"1"
        w.discard(rid)
    # 160 tokens; a write per token would be 160 round trips.
    assert counting.writes < 40
    await w.stop()


async def test_first_token_is_not_held_for_the_window(line: Line) -> None:
    w = StreamWriter(line, window_s=5.0)
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    w.open(a, 1)
    w.push(a, "x")  # starts a long window after its write
    await asyncio.sleep(0.05)
    w.open(b, 1)
    w.push(b, "y")
    await asyncio.wait_for(w.close(b), 1.0)  # b's first token (and its close) cut a's window short
    assert await texts(line, b) == ["y"]
    await asyncio.wait_for(w.close(a), 1.0)
    await w.stop()


async def test_close_waits_for_the_last_token_then_the_final_event_follows(line: Line) -> None:
    [rid] = [uuid.uuid4().hex]
    await line.enqueue(rid, Priority.interactive, orjson.dumps({}), 30_000)
    [claimed] = await line.claim("w", 1, 5)
    w = StreamWriter(line, window_s=0.2)
    w.open(rid, claimed.attempt)
    for t in ("a", "b", "c"):
        w.push(rid, t)
    await w.close(rid)
    assert await line.finish(rid, "completed", {"t": "done"}, owner="w")
    events = [orjson.loads(f[b"e"]) for _, f in await line.redis.xrange(line.keys.result(rid))]
    assert "".join(e.get("x", "") for e in events[:-1]) == "abc"
    assert events[-1]["t"] == "done"
    await w.stop()


async def test_discarded_stream_writes_nothing_more(line: Line) -> None:
    w = StreamWriter(line, window_s=0.2)
    rid = uuid.uuid4().hex
    w.open(rid, 1)
    w.push(rid, "first")
    await asyncio.sleep(0.05)  # written; the window runs
    w.push(rid, "dropped")
    w.discard(rid)  # cancelled: what is buffered goes nowhere
    await asyncio.sleep(0.3)
    assert await texts(line, rid) == ["first"]
    await w.stop()
