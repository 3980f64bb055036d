"""When the fleet's Redis stops answering (down, restarting, or frozen): bounds and the loose ends.

Three rules, each with its why:

- **A caller's deadline holds.** Every Redis call on a request's path runs
  under the request's deadline plus `GRACE_S` (a frozen Redis does not reset
  the connection, so only a clock can tell). Past it the caller gets the typed
  503 `redis_unavailable` with Retry-After: the fleet, not the request, is at
  fault, and a retry a second later may well succeed.
- **Told 503, never served.** A request that may have joined the line before
  Redis went away, and whose caller was told 503 (or got a stream's final
  `error` event), is an `Orphan`: the gateway keeps it in memory and ends it in
  the line with outcome `unavailable` as soon as Redis answers again (a running
  one is aborted in its engine), so nothing is served that nobody will read.
  Its memory is not the only record: every call is recorded in Redis with the
  gateway process answering for it (`caller_id`, `fleet.store.callers`), so a
  gateway that dies or is restarted during the outage has its calls ended by the
  gateways that live on, once its lease runs out (a restarted one among them).
- **One outcome, counted once, the same word in Redis and in Prometheus**:
  the orphan's metric is counted when its caller is answered; the line counts
  the same outcome when the orphan is ended there.

`/readyz` pings with its own short bound (`READY_PING_S`) instead of the
calls client's five-second read timeout, so a load balancer learns within a
second that this gateway cannot serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from fleet.outcome import Outcome
from gateway.errors import APIError, retry_headers

if TYPE_CHECKING:
    from fleet.store.line import Line
    from gateway.tickets import Ticket

log = logging.getLogger("fleet.gateway.redis_loss")

READY_PING_S = 0.8  # /readyz: a Redis that cannot PONG in this long cannot serve calls either
GRACE_S = 1.0  # beyond a request's deadline, what its Redis calls may take before it is answered 503
CLEANUP_S = 1.0  # a clean-up call on the way out (cancel, release) waits no longer; the orphan sweep retries
ORPHAN_WATCH_S = 10.0  # a delayed enqueue may still land after Redis returns: watch for it this long

_caller: tuple[int, str] = (0, "")


def caller_id() -> str:
    """This gateway process's name in the callers record: its host, its pid and a random part, so a
    restarted (or forked, `--workers N`) process is a caller of its own."""
    global _caller
    if _caller[0] != os.getpid():
        _caller = (os.getpid(), f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return _caller[1]


def unavailable_error(exc: BaseException | None, *, deadline_ms: int | None = None) -> APIError:
    """The typed 503 of the contract, with Retry-After."""
    if deadline_ms is not None and not isinstance(exc, RedisError):
        why = f"did not answer within the request's deadline of {deadline_ms} ms"
    else:
        why = f"is unavailable ({type(exc).__name__ if exc else 'no answer'})"
    return APIError(503, f"the fleet's Redis {why}; retry shortly", "service_unavailable",
                    code="redis_unavailable", headers=retry_headers(1))


async def end_in_line(line: Line, rid: str, outcome: Outcome, *, bound_s: float = CLEANUP_S) -> Outcome | None:
    """End a request in the line with `outcome`; the outcome the line recorded for it.

    Ours when this call ended it; the earlier one when someone else (a worker's
    completion, the deadline) got there first, so the gateway's metric says what
    Redis says; None when Redis did not answer within `bound_s`.
    """
    try:
        async with asyncio.timeout(bound_s):
            if await line.finish(rid, outcome) is not None:
                return outcome
            return Outcome(await line.outcome(rid) or outcome)
    except (RedisError, TimeoutError):
        return None


@dataclass(slots=True)
class Orphan:
    line: Line
    rid: str
    outcome: Outcome  # what its caller was told (`fleet.outcome.recorded_in_line`)
    ticket: Ticket | None
    answered_since: float | None = None  # loop time Redis first answered for it while its hash was missing


class Orphans:
    """Requests answered for their caller but not yet ended in the line; `sweep` ends them."""

    def __init__(self) -> None:
        self.pending: dict[str, Orphan] = {}

    def add(self, line: Line, rid: str, outcome: Outcome, ticket: Ticket | None) -> None:
        """`rid`'s caller was told `outcome` (its `Call` counted it): end it so in the line when Redis answers."""
        self.pending[rid] = Orphan(line, rid, outcome, ticket)

    async def sweep(self) -> None:
        """End each orphan in the line, while Redis answers (called every heartbeat)."""
        loop = asyncio.get_running_loop()
        for rid, o in list(self.pending.items()):
            try:
                async with asyncio.timeout(CLEANUP_S):
                    ended = await o.line.finish(rid, o.outcome)
                    state = None if ended else await o.line.outcome(rid)
            except (RedisError, TimeoutError):
                return  # still away: try them all again next beat
            if ended is None and state is None:
                # No such request (yet): its enqueue may never have run, or may still land.
                now = loop.time()
                o.answered_since = o.answered_since or now
                if now - o.answered_since < ORPHAN_WATCH_S:
                    continue
            elif ended is not None:
                log.warning("request %s ended %s in the line after Redis returned (was %s; its caller had "
                            "been answered)", rid, o.outcome, ended)
            elif state != o.outcome:
                # It ended (a worker completed it) just as Redis went away, but its caller was told
                # otherwise: count what the caller was told, in Redis as in the metrics.
                log.warning("request %s had ended %s before Redis went away; its caller was told %s",
                            rid, state, o.outcome)
                try:
                    async with asyncio.timeout(CLEANUP_S):
                        await o.line.relabel(rid, state, o.outcome)
                except (RedisError, TimeoutError):
                    return
            self.pending.pop(rid, None)
            if o.ticket is not None:
                with contextlib.suppress(Exception):
                    await o.ticket.close(o.outcome)
