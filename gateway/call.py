"""The life of one call in the gateway, in one owner: `Call`.

A call is admitted (a `Ticket` holding its reservations), watched (its result stream, read by
the process's one result reader), joined to its tier's line, and read until its end; meanwhile
one watcher listens for its client leaving (`ClientWatch`), for the first-event race and the
stream alike. Whatever happens, `end` runs once, and it is the only clean-up: it closes the
watch and the events, ends the request in the line when the gateway is the one ending it (or
hands it to the orphan sweep when Redis does not answer), closes the ticket, and counts the
one outcome its caller was told in `fleet_requests_total` (docs/metrics.md).

    async with Call(gw, spec, caller, headers) as call:   # any exception inside ends the call
        first = await call.first()                          # a chunk or the whole answer
        return answer_whole(call, first)  /  stream(call, first)   # the stream ends it itself

A call refused before it reaches the line (its body, its key, admission's 429) ends the same
way, with nothing to clean up but its count.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
from redis.exceptions import RedisError

from fleet import metrics
from fleet.config import Priority
from fleet.prefix import affinity_key
from fleet.store.events import Chunk, Done, Event, Failed
from fleet.tasks import spawn
from gateway.admission import AdmissionRequest
from gateway.auth import Caller
from gateway.call_spec import CallSpec, fair_place
from gateway.client_watch import ClientGone, ClientWatch
from gateway.errors import APIError, from_event
from gateway.observability import RequestRecorder
from gateway.redis_loss import GRACE_S, UNAVAILABLE, end_in_line, unavailable_error
from gateway.results import close_events, events
from gateway.tickets import Ticket, Usage, outcome_of

if TYPE_CHECKING:
    from gateway.result_reader import Watch
    from gateway.state import Gateway

log = logging.getLogger("fleet.gateway")

SHED, REFUSED, CANCELLED, FAILED, COMPLETED = "shed", "refused", "cancelled", "failed", "completed"


@dataclass(frozen=True, slots=True)
class CallHeaders:
    """The fleet's own headers of a call, read and checked (`gateway.request`)."""

    priority: Priority
    deadline_ms: int
    chain: str = ""
    flow: str = ""  # its flow within its class in a fair tier (`gateway.call_spec.call_flow`)


class Call:
    """One call's watch, events, ticket, orphan hand-off and outcome, ended once (see module doc)."""

    def __init__(self, gw: Gateway, spec: CallSpec, caller: Caller, headers: CallHeaders, client: ClientWatch,
                 rid: str | None = None) -> None:
        self.gw, self.spec, self.caller, self.client = gw, spec, caller, client
        self.priority, self.deadline_ms, self.chain = headers.priority, headers.deadline_ms, headers.chain
        self.flow = headers.flow or f"key:{caller.name}"
        self.rid = rid or uuid.uuid4().hex
        self.line = gw.lines[spec.tier]
        self.deadline_at = asyncio.get_running_loop().time() + self.deadline_ms / 1000
        self.created = int(time.time())
        self.rec = RequestRecorder(spec.tier, self.priority.name)
        self.ticket: Ticket | None = None
        self.watch: Watch | None = None
        self.events: AsyncIterator[Event] | None = None
        self.told: str | None = None  # the outcome its caller was told: set once, by `end`
        self.streaming = False  # handed to a stream, which ends it when it is done
        self.chain_open = False  # counted open in its chain's record: `end` closes it

    @property
    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.rid, "x-fleet-tier": self.spec.tier, "x-fleet-priority": self.priority.name}

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is None and self.streaming:
            return  # the stream owns the call now
        with anyio.CancelScope(shield=True):  # the clean-up must run even while being cancelled
            await self.end(_outcome_of_exception(exc))

    # --- the call's path ----------------------------------------------------------------------

    async def first(self) -> Chunk | Done:
        """Admit, watch, join the line and wait for the first event, all under the caller's
        deadline (plus a grace: a frozen Redis resets nothing, so only a clock ends the wait).
        A failure event is raised as its typed error; the client leaving as `ClientGone`; Redis
        away or silent as the typed 503 (the request, which may have joined, becomes an orphan)."""
        try:
            async with asyncio.timeout_at(self.deadline_at + GRACE_S):
                if self.chain:  # its chain is open while any of its calls is (fleet.store.chains)
                    await self.gw.chains.start(self.chain, self.spec.tier, self.priority.name)
                    self.chain_open = True
                await self._join()
                assert self.events is not None
                first = await self.client.race(self.events.__anext__())
        except (RedisError, TimeoutError) as e:
            log.error("request %s: Redis unavailable (%s)", self.rid, type(e).__name__)
            await self.end(UNAVAILABLE)
            raise self._typed(unavailable_error(e, deadline_ms=self.deadline_ms)) from None
        if isinstance(first, Failed):
            await self.end(outcome_of(first), in_line=True)
            raise self._typed(from_event(first))
        return first

    async def _join(self) -> None:
        """Admission (rate limits, budgets, the tier's drain and the deadline: a typed 429 with
        Retry-After, or a ticket), then the watch, then the line."""
        spec = self.spec
        output = self.gw.admission.views[spec.tier].capacity.output_estimate(spec.explicit_max_tokens)
        weight = self.caller.key.weight if self.caller.key else 1.0
        self.ticket = await self.gw.admission.admit(AdmissionRequest(
            rid=self.rid, caller=self.caller, tier=spec.tier, priority=self.priority, deadline_ms=self.deadline_ms,
            prompt_tokens=spec.prompt_tokens, max_tokens=spec.max_tokens, expected_output_tokens=output,
            place=fair_place(self.gw.cfg, spec.tier, self.flow, prompt_tokens=spec.prompt_tokens,
                             output_tokens=output, weight=weight)))
        # Watched before it joins the line, so the reader takes the stream in while the enqueue runs
        # (which rings the reader itself when its read in flight must be told: `Watch.wake`).
        self.watch = watch = self.gw.results.watch(self.line, self.rid, ring=False)
        try:
            await self.ticket.enqueue(self.line, spec.payload(self.caller.name), self.chain,
                                      affinity=affinity_key(self.chain, spec.prefix), wake=watch.wake)
        except BaseException:
            watch.ring_apart()
            raise
        self.events = events(self.watch, self.line, self.deadline_at)

    async def next(self) -> Event:
        """The call's next event after the first (streaming); Redis away raises its error."""
        assert self.events is not None
        return await self.events.__anext__()

    def completed(self, done: Done) -> None:
        """The answer came whole: its histograms now (the end settles the ticket with its usage)."""
        self.rec.done(done)

    # --- the one end --------------------------------------------------------------------------

    async def end(self, told: str, usage: Usage | None = None, *, in_line: bool = False) -> None:
        """End the call once, as its caller was told `told`. `in_line`: the line already ended it
        (a worker's done or failure, the deadline's event); else the gateway ends it there now
        (cancelled, failed), or the orphan sweep does once Redis answers again. Then close the
        ticket and count the outcome. Later calls do nothing."""
        if self.told is not None:
            return
        self.told = told
        self.client.stop()
        if self.chain_open:  # refused or late unless it completed (a caller hanging up is neither)
            spawn(self.gw.chains.end(self.chain, told not in (COMPLETED, CANCELLED)))
        if self.watch is not None:
            self.watch.close()
        if self.events is not None:
            spawn(close_events(self.events))  # Redis calls of its own: off the caller's path
        if self.ticket is None:  # never reached the line: nothing to end but the count
            self._count(told)
            return
        outcome: str | None = told
        if told == UNAVAILABLE:
            outcome = None
        elif not in_line:
            # What the line records is what is counted: a worker may have completed it a moment before.
            outcome = await end_in_line(self.line, self.rid, CANCELLED if told == CANCELLED else FAILED)
        if outcome is None:  # Redis did not answer: ended there once it does, counted as told
            self.gw.orphans.add(self.line, self.rid, told if told in (CANCELLED, UNAVAILABLE) else FAILED,
                                self.ticket)
            self._count(told if told in (CANCELLED, UNAVAILABLE) else FAILED)
            return
        spawn(self.ticket.close(outcome, usage))
        self._count(outcome)

    def _count(self, outcome: str) -> None:
        metrics.REQUESTS.labels(self.spec.tier, self.priority.name, outcome).inc()

    def _typed(self, err: APIError) -> APIError:
        err.headers.update(self.headers)
        return err


def count_refused(tier: str | None, priority: str | None, outcome: str) -> None:
    """fleet_requests_total for a call refused before a `Call` was made (its body, its key)."""
    metrics.REQUESTS.labels(tier or "none", priority or "none", outcome).inc()


def _outcome_of_exception(exc: BaseException | None) -> str:
    """What the caller is told when a call ends by an exception."""
    if exc is None:  # left without an answer told (a path that forgot its end): ended as failed
        return FAILED
    if isinstance(exc, ClientGone):
        return CANCELLED
    if isinstance(exc, APIError):
        return SHED if exc.status == 429 else UNAVAILABLE if exc.status == 503 else REFUSED
    if isinstance(exc, RedisError | TimeoutError):
        return UNAVAILABLE
    return FAILED
