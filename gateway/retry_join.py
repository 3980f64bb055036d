"""A call whose client left while its SDK will retry it: kept for the retry, then ended if none came.

An agent's SDK that times out closes the connection and, after a backoff of at most 8 s,
sends the same body again (`x-stainless-retry-count` 1, then 2). Cancelling the call when the
first attempt's client leaves throws away the work done, and the retry starts from nothing:
a call longer than its client's timeout is then never answered. So instead:

- the owner (the `Call` that admitted it, `keep_for_retry`) parks it in Redis under its
  identity (`fleet.store.retries`) for `client_clock.retry_grace_s`, and goes on reading its
  events with nobody to send them to, so that it still ends in exactly one outcome, counted
  and billed once (invariant 1);
- a retry of the same identity, through any gateway, takes it over in its admission script
  (`fleet.store.admitting`) and reads the call's result stream from its start: the answer
  whole, or the stream from its first chunk and then live (`Call.follow`);
- a park that nobody takes within the grace ends the call as cancelled: the engine works at
  most the grace for a client that never returns (invariant 9).

The result stream of a parked call is kept (not dropped as a read one is) for the grace after
the call ends, so that a retry that comes between the attempts still gets the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Protocol

from redis.exceptions import RedisError

from fleet import metrics
from fleet.outcome import Outcome
from fleet.store.events import Done, Failed, decode
from fleet.store.keys import TierKeys
from fleet.store.line import Line
from gateway.call_spec import CallSpec
from gateway.redis_loss import CLEANUP_S
from gateway.results import EXPIRED, GIVE_UP_AFTER_S
from gateway.tickets import Usage

if TYPE_CHECKING:
    from gateway.state import Gateway


class Call(Protocol):
    """What of a `gateway.call.Call` a kept call needs (a protocol: the call module imports this one)."""

    gw: Gateway
    spec: CallSpec
    line: Line
    rid: str
    identity: str
    digest: str
    deadline_at: float
    asked_tier: str
    degraded_from: str
    degrade_reason: str

    def completed(self, done: Done) -> None: ...

    async def finish(self, told: Outcome, usage: Usage | None = None, *, in_line: bool = False) -> None: ...

log = logging.getLogger("fleet.gateway.retries")

GONE = Failed(499, "cancelled", "the client left and no retry of the call came within its grace", "client_gone")


def grace_s(call: Call) -> float:
    return call.gw.cfg.client_clock.retry_grace_s


def record_keys(call: Call) -> TierKeys:
    """Where the call's retry record lives: the tier its caller asked for, which its SDK's retry
    asks again, also when a smaller tier serves it (`gateway.degrade`)."""
    return call.gw.lines[call.asked_tier].keys if call.asked_tier in call.gw.lines else call.line.keys


async def park(call: Call) -> bool:
    """Record the call as waiting for a retry of it; False when Redis did not answer (it is then
    cancelled as any call whose client left)."""
    try:
        async with asyncio.timeout(CLEANUP_S):
            runs_in, why = (call.spec.tier, call.degrade_reason) if call.degraded_from else ("", "")
            await call.gw.retries.park(record_keys(call), call.identity, call.rid, call.digest,
                                       int(grace_s(call) * 1000), runs_in, why)
    except (RedisError, TimeoutError):
        return False
    metrics.RETRIES.labels(call.spec.tier, "parked").inc()
    return True


async def keep_for_retry(call: Call) -> None:
    """The owner's rest of the call once its client left (parked), on its own task: wait for its
    end in the line, ending it there as cancelled once its park is gone (its grace passed and no
    retry holds it: a retry that took it and left again parks it again) or as expired at its
    deadline, then end the call once with its outcome and keep its answer the grace for a retry.

    It watches the call's outcome record, not its result stream: a retry reading that stream in
    this same process holds the reader's one watch of it."""
    loop = asyncio.get_running_loop()
    step = max(0.05, min(1.0, grace_s(call) / 4))
    keys = call.line.keys
    last: object = None
    outcome: str | None = None
    while outcome is None:
        await asyncio.sleep(step)
        try:
            async with asyncio.timeout(CLEANUP_S):
                outcome = await call.line.outcome(call.rid)
                if outcome is not None:
                    last = await _last_event(call)
                elif loop.time() >= call.deadline_at:
                    await call.line.finish(call.rid, Outcome.EXPIRED, EXPIRED)
                elif await call.gw.retries.state(record_keys(call), call.identity, call.rid) is None:
                    await call.line.finish(call.rid, Outcome.CANCELLED, GONE)
                    metrics.RETRIES.labels(call.spec.tier, "abandoned").inc()
        except (RedisError, TimeoutError):
            if loop.time() > call.deadline_at + GIVE_UP_AFTER_S:
                await call.finish(Outcome.UNAVAILABLE)  # the orphan sweep ends it once Redis answers
                return
    usage = None
    if isinstance(last, Done):
        call.completed(last)
        usage = Usage(last.prompt_tokens, last.completion_tokens)
    # Whoever takes it over within the grace still finds the answer: the stream outlives the call by it.
    with contextlib.suppress(RedisError, TimeoutError):
        async with asyncio.timeout(CLEANUP_S):
            await call.line.redis.pexpire(keys.result(call.rid), max(1, int(grace_s(call) * 1000)))
    await call.finish(Outcome(outcome), usage, in_line=True)


async def _last_event(call: Call) -> object:
    """The call's final event, the last entry of its result stream (None if it has none)."""
    got = await call.line.redis.xrevrange(call.line.keys.result(call.rid), count=1)
    return decode(got[0][1]) if got else None
