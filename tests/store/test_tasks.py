"""Stopping a task that awaits Redis: a drained replica's heartbeat loop (and the gateway's
reader loops) must end when cancelled, at once.

redis-py writes a command under `asyncio.wait_for`, which on Python 3.11 drops a cancel that lands
as the write ends: one cancel in a few dozen was lost, and a replica's clean stop logged "still runs
1.0 s after its cancel". The parts' clients write in the caller's task (fleet.store.sending), so one
cancel ends the task; `fleet.tasks.cancel_and_wait` stays the backstop for a cancel lost anywhere else.

Before `cancel_and_wait`, one `cancel()` and a wait left such a loop beating for ever: a SIGTERMed
replica kept saying "draining" and never exited (tests/processes/test_model_rollout.py failed under
load waiting for the drained replicas to leave)."""

from __future__ import annotations

import asyncio
import random
import uuid

from fleet.store.connection import Clients
from fleet.store.sending import CancelSafeSend
from fleet.tasks import cancel_and_wait


async def test_a_loop_on_redis_always_stops_though_a_cancel_gets_lost(redis_url: str) -> None:
    clients = Clients.open(redis_url, name="test-tasks")  # the parts' own clients, socket timeout and all
    r, key, lost = clients.calls, f"test-tasks:{uuid.uuid4().hex}", 0

    beats: dict[asyncio.Task[None] | None, int] = {}

    async def beat() -> None:  # a heartbeat loop: as the worker's, it stops only by cancellation
        while True:
            await asyncio.sleep(0.001)
            await r.hset(key, "beat", "1")
            me = asyncio.current_task()
            beats[me] = beats.get(me, 0) + 1

    try:
        for _ in range(100):
            t = asyncio.create_task(beat())
            await asyncio.sleep(random.uniform(0, 0.01))  # a cancel at any point of its beat
            t.cancel()
            await asyncio.wait({t}, timeout=1.0)
            lost += not t.done()  # that one cancel was swallowed: it beats on
            await asyncio.wait_for(cancel_and_wait(t), 10)  # ... and is stopped all the same
            assert t.done()
        # Several loops at once, each cancelled again until it has ended.
        many = [asyncio.create_task(beat()) for _ in range(20)]
        # Each has beaten (been to Redis and back) before the cancel: a loop cancelled before its
        # first await of Redis would stop on any cancel, and the check below would prove nothing.
        async with asyncio.timeout(10):
            while not all(beats.get(t) for t in many):  # noqa: ASYNC110 (the loops have no event to await)
                await asyncio.sleep(0.001)
        await asyncio.wait_for(cancel_and_wait(*many, None), 10)
        assert all(t.done() for t in many)
    finally:
        await r.delete(key)
        await clients.aclose()
    print(f"cancellations lost and retried: {lost} of 100")


async def test_one_cancel_ends_a_loop_on_redis_wherever_it_lands(redis_url: str) -> None:
    """What a heartbeat does (a hash write, a pipeline), cancelled at random points 300 times:
    each time the loop has ended within the second, no second cancel needed (redis-py's own
    write lost about one in forty on Python 3.11)."""
    clients = Clients.open(redis_url, name="test-tasks")
    r, key = clients.calls, f"test-tasks:{uuid.uuid4().hex}"
    assert issubclass(r.connection_pool.connection_class, CancelSafeSend)
    beats = 0

    async def beat() -> None:
        nonlocal beats
        while True:
            await asyncio.sleep(0.001)
            await r.hset(key, "beat", "1")
            async with r.pipeline(transaction=False) as p:
                await p.hincrby(key, "n", 1).expire(key, 60).execute()
            beats += 1

    lost = 0
    try:
        for _ in range(300):
            t = asyncio.create_task(beat())
            await asyncio.sleep(random.uniform(0, 0.01))
            t.cancel()
            await asyncio.wait({t}, timeout=1.0)
            lost += not t.done()
            await cancel_and_wait(t)
        assert beats > 300  # the cancels landed in loops at work, not before their first write
    finally:
        await r.delete(key)
        await clients.aclose()
    assert lost == 0, f"{lost} of 300 cancels were lost in a Redis call"
