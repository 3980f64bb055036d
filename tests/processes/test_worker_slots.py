"""A replica's slots come back however its calls end, with the sim engine and a real Redis.

Found live (the fair line's test, about one run in four): a flood's callers all hung up at once,
some cancels reached the replica in the loop turn of the claim that took their calls, and a task
cancelled before its first step never ran its coroutine, so the slot freed in its `finally` was
never freed. A replica that lost all its slots so claimed nothing more, and the next caller waited
out its timeout in a line that a ready replica never read."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from fleet.config import Priority, load_config
from fleet.store.line import Claimed
from tests.harness import TEST_CONFIG, call_payload, until
from workers.engines.sim import SimEngine
from workers.worker import Worker

TIER = "planner"  # two slots, a lease of a second


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_url)
    yield r
    await r.aclose()


async def test_calls_cancelled_in_their_claims_loop_turn_give_their_slots_back(redis: Redis) -> None:
    cfg = load_config(TEST_CONFIG, namespace=f"t{uuid.uuid4().hex[:8]}")
    w = Worker(cfg, TIER, SimEngine(cfg.tiers[TIER].sim), redis, replica_id="r0")
    run = asyncio.create_task(w.run())
    try:
        await until(lambda: w.state == "ready", "the replica ready")
        start = w._start
        cancelled: list[str] = []

        def start_then_cancel(c: Claimed) -> None:
            """The caller's cancel lands in the claim's own loop turn, before the call's task runs."""
            start(c)
            w._cancel(c.rid)
            cancelled.append(c.rid)

        w._start = start_then_cancel  # type: ignore[method-assign]
        first = [await _put(w, 8) for _ in range(w.concurrency)]
        await until(lambda: len(cancelled) == w.concurrency, "a claim of each slot, cancelled at once")
        w._start = start  # type: ignore[method-assign]
        # Every slot is free again, so the replica claims on: the next calls, and those the cancelled
        # attempts held (back in the line when their leases lapse, as after a replica's stall), all end.
        await until(lambda: not w.active, "every slot free again after its call was cancelled", 10)
        later = [await _put(w, 8) for _ in range(w.concurrency)]
        for rid in later + first:
            await until(lambda r=rid: _outcome(redis, w, r), f"{rid} completed", 30)
            assert await _outcome(redis, w, rid) == "completed"
    finally:
        w.drain()
        await asyncio.wait_for(run, 30)


async def _put(w: Worker, max_tokens: int) -> str:
    rid = uuid.uuid4().hex
    await w.line.enqueue(rid, Priority.interactive, call_payload("p" * 40, max_tokens, key="k1"), 60_000)
    return rid


async def _outcome(redis: Redis, w: Worker, rid: str) -> str | None:
    raw = await redis.hget(w.line.keys.request(rid), "outcome")
    return raw.decode() if raw else None
