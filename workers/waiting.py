"""A replica's wait for work: the bell and the claim in one round trip, ended early by a drain or park.

An idle replica used to block on its tier's bell, hear it ring, then ask for a
claim: two round trips (four process hops) between an enqueue and the request
reaching the engine. `Line.wait_and_claim` sends both at once, so Redis runs the
claim the moment the bell rings. A drain or park must not wait out the block
(up to a second), and cancelling the wait could drop a claim Redis has just run
with no one left to read it: so the replica rings its own wake key, the wait
ends at once, and what its claim took is served like anything else in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fleet.store.line import Claims, Line
from fleet.tasks import cancel_and_wait

WAIT_S = 1.0  # the longest wait on the bell before claiming anyway (a missed ring costs at most this)
RING_S = 0.5  # a drain's ring, then the wait's end, are waited for this long each (a frozen Redis: given up)


async def wait_and_claim(line: Line, holding: asyncio.Event, wake: str, replica: str, free: int, lease_s: float,
                         caps: tuple[int, ...] | None, *, timeout_s: float = WAIT_S) -> Claims:
    """Wait for the bell and claim up to `free` (see `Line.wait_and_claim`), `timeout_s` at most; `holding`
    set meanwhile (drain, park) rings `wake` so the wait ends now. Raises the wait's Redis error."""
    wait = asyncio.ensure_future(line.wait_and_claim(replica, free, lease_s, caps, timeout_s=timeout_s, wake=wake))
    hold = asyncio.ensure_future(holding.wait())
    try:
        await asyncio.wait({wait, hold}, return_when=asyncio.FIRST_COMPLETED)
        if not wait.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(line.ring(wake), RING_S)
            await asyncio.wait({wait}, timeout=timeout_s + RING_S)
    finally:
        hold.cancel()
        if not wait.done():  # Redis frozen (or this task cancelled): give the wait up, as before
            await cancel_and_wait(wait)
    return Claims() if wait.cancelled() else wait.result()


async def first_of(*waits: Any) -> None:
    """Until the first of `waits` completes (a parked replica: resumed or drained); the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
