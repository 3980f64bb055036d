"""Reading one request's result stream, racing the deadline and the client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fleet.store.line import Line
from fleet.tasks import cancel_and_wait
from gateway.redis_loss import GRACE_S, spawn
from gateway.result_reader import Watch

# After the deadline, how long to wait for the final event before answering without it.
GIVE_UP_AFTER_S = 5.0


class ClientGone(Exception):
    """The caller disconnected."""


async def events(watch: Watch, line: Line, deadline_at: float) -> AsyncIterator[dict[str, Any]]:
    """Yield the request's events until its final one (done or err), as the
    process's result reader (`gateway.result_reader`) hands them to `watch`.

    When the gateway's own clock passes the deadline, the request is ended
    as expired (whatever state it is in: in the line it leaves, running it is
    aborted in its engine) and the 504 event that `finish` writes is read
    like any other. If a worker finished first, its event wins.
    """
    rid = watch.rid
    expired_sent = False
    loop = asyncio.get_running_loop()
    try:
        while True:
            left = deadline_at - loop.time()
            if left <= 0 and not expired_sent:
                expired_sent = True
                async with asyncio.timeout(GRACE_S):  # a frozen Redis must not hold the caller's answer
                    await line.finish(rid, "expired", {"t": "err", "status": 504, "type": "deadline_exceeded",
                                                       "msg": "deadline passed before the request finished"})
            if left < -GIVE_UP_AFTER_S:
                # The final event never came (the request's keys are gone: an evicting
                # or restarted Redis). The caller still gets its answer, not a hang.
                yield {"t": "err", "status": 504, "type": "deadline_exceeded",
                       "msg": "deadline passed and the request's result was lost"}
                return
            ev = await watch.next(left if left > 0 else GIVE_UP_AFTER_S + left + 0.001)
            if ev is None:
                continue
            yield ev
            if ev["t"] in ("done", "err"):
                return
    finally:
        watch.close()
        # Read, so drop it now rather than at its TTL, off the caller's path.
        spawn(_drop(line, rid))


async def close_events(stream: AsyncIterator[dict[str, Any]]) -> None:
    """Close a request's event reader off the caller's path; a reader already gone is fine."""
    with contextlib.suppress(Exception):
        await stream.aclose()  # type: ignore[attr-defined]


async def _drop(line: Line, rid: str) -> None:
    with contextlib.suppress(Exception):  # Redis away: the stream's TTL drops it instead
        await line.drop_events(rid)


async def wait_disconnect(receive: Any) -> None:
    """Return when the ASGI server reports the client gone (body already read)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def first_or_gone(agen: AsyncIterator[dict[str, Any]], receive: Any) -> dict[str, Any]:
    """The next event, or ClientGone if the caller leaves first."""
    nxt = asyncio.ensure_future(agen.__anext__())
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (the deadline's bound): the pending read must not run on
        nxt.cancel()
        raise
    finally:
        gone.cancel()
    if nxt.done():
        return nxt.result()
    await cancel_and_wait(nxt)  # a read awaiting Redis can lose one cancel (fleet/tasks.py)
    raise ClientGone
