"""The life of one call in the gateway, in one owner: `Call`.

A call is admitted (a `Ticket` holding its reservations), watched (its result stream, read by
the process's one result reader), joined to its tier's line, and read until its end; meanwhile
one watcher listens for its client leaving (`ClientWatch`), for the first-event race and the
stream alike. Whatever happens, `end` runs once, and it is the only clean-up: it closes the
watch and the events, ends the request in the line when the gateway is the one ending it (or
hands it to the orphan sweep when Redis does not answer), closes the ticket, and counts the
one outcome its caller was told in `fleet_requests_total` (docs/metrics.md). The outcome is
always `fleet.outcome.infer_outcome` of what ended it (a final event, an exception, a refusal).

    async with Call(gw, spec, caller, headers) as call:   # an exception before the answer ends the call
        first = await call.first()                          # a chunk or the whole answer
        return await whole(call, first)  /  stream(call, first)   # the answer owns the end

Once an answer exists, it owns the end: `gateway.answers.whole` ends the call in its own
`finally` before its body goes out, a stream's response (`gateway.answers.SSEResponse`) in its
`finally` once it stops, whether or not a byte was sent. A call refused before it reaches the
line (its body, its key, admission's 429) ends here too, with nothing to clean up but its count.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import orjson
from redis.exceptions import RedisError

from fleet import metrics
from fleet.config import Priority
from fleet.degrade_config import DegradeWish
from fleet.outcome import Outcome, infer_outcome, recorded_in_line
from fleet.policy import default_max_tokens
from fleet.policy.client_clock import CallClock
from fleet.policy.degrade import DegradeAsk
from fleet.policy.retries import call_identity
from fleet.prefix import affinity_key
from fleet.store.admitting import Attempt
from fleet.store.events import Chunk, Done, Event, Failed
from fleet.store.flows import Place
from fleet.tasks import spawn
from gateway import retry_join
from gateway.admission import AdmissionRequest, Joined
from gateway.auth import Caller
from gateway.call_spec import CallSpec, fair_place
from gateway.client_watch import ClientWatch
from gateway.errors import APIError, from_event, retry_headers
from gateway.observability import RequestRecorder
from gateway.redis_loss import GRACE_S, end_in_line, unavailable_error
from gateway.results import close_events, drop_soon, events
from gateway.tickets import Ticket, Usage

if TYPE_CHECKING:
    from gateway.result_reader import Watch
    from gateway.state import Gateway

log = logging.getLogger("fleet.gateway")

FORGIVEN_S = 0.001  # the half-life that forgives at once what a chain under way was served

@dataclass(frozen=True, slots=True)
class CallHeaders:
    """The fleet's own headers of a call, read and checked (`gateway.request`)."""

    priority: Priority
    clock: CallClock  # its deadline and where it came from (`fleet.policy.client_clock`)
    chain: str = ""
    flow: str = ""  # its flow within its class in a fair tier (`gateway.call_spec.call_flow`)
    idempotency_key: str | None = None  # `Idempotency-Key`: its identity for a retry (`fleet.policy.retries`)
    chain_deadline_ms: int | None = None  # `X-Chain-Deadline-Ms`: sets its chain's deadline if it has none
    degrade: DegradeWish | None = None  # `X-Fleet-Degrade` (docs/degrade.md)

    @property
    def deadline_ms(self) -> int:
        return self.clock.deadline_ms


class Call:
    """One call's watch, events, ticket, orphan hand-off and outcome, ended once (see module doc)."""

    def __init__(self, gw: Gateway, spec: CallSpec, caller: Caller, headers: CallHeaders, client: ClientWatch,
                 rid: str | None = None) -> None:
        self.gw, self.spec, self.caller, self.client = gw, spec, caller, client
        self.priority, self.deadline_ms, self.chain = headers.priority, headers.deadline_ms, headers.chain
        self.clock = headers.clock
        self.flow = headers.flow or f"key:{caller.name}"
        self.rid = rid or uuid.uuid4().hex
        self.line = gw.lines[spec.tier]
        self.asked_tier = spec.tier  # the tier it named; `spec.tier` is the one serving it (`gateway.degrade`)
        self.degrade_wish = headers.degrade
        self.degraded_from = self.degrade_reason = ""
        self.deadline_at = asyncio.get_running_loop().time() + self.deadline_ms / 1000
        self.created = int(time.time())
        self.rec = RequestRecorder(spec.tier, self.priority.name)
        self.ticket: Ticket | None = None
        self.watch: Watch | None = None
        self.events: AsyncIterator[Event] | None = None
        self.told: Outcome | None = None  # the outcome its caller was told: set once, by `end`
        self.chain_open = False  # counted open in its chain's record: `end` closes it
        self.chain_deadline_ms = headers.chain_deadline_ms
        self.opens_chain = False  # its chain had no call served or open: shed before chains under way
        # A call its SDK will retry can be taken over by the retry (`gateway.retry_join`): its identity.
        cc = gw.cfg.client_clock
        may_retry = headers.idempotency_key is not None or (self.clock.attempts_left or 0) > 0
        self.retryable = cc.enabled and cc.retry_grace_s > 0 and may_retry
        self.identity, self.digest = (call_identity(caller.name, spec.raw, headers.idempotency_key)
                                      if self.retryable else ("", ""))
        self.joined = False  # a retry reading the call an earlier attempt started (`follow`)
        self.parked = False  # its client left; it waits for a retry (`gateway.retry_join`)

    @property
    def headers(self) -> dict[str, str]:
        h = {"x-request-id": self.rid, "x-fleet-tier": self.spec.tier, "x-fleet-priority": self.priority.name}
        if self.degraded_from:
            h["x-fleet-degraded-from"], h["x-fleet-degrade-reason"] = self.degraded_from, self.degrade_reason
        return h

    def model_named(self, asked: str) -> str:
        """The `model` an answer names when its engine names none: what the caller asked, or the
        tier that served it when it was degraded."""
        return self.spec.tier if self.degraded_from else asked

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is None:
            return  # an answer was made: it owns the end (module doc), whole or streamed
        with anyio.CancelScope(shield=True):  # the clean-up must run even while being cancelled
            await self.end(infer_outcome(exc))

    # --- the call's path ----------------------------------------------------------------------

    async def first(self) -> Chunk | Done:
        """Admit, watch, join the line and wait for the first event, all under the caller's
        deadline (plus a grace: a frozen Redis resets nothing, so only a clock ends the wait).
        A failure event is raised as its typed error; the client leaving as `ClientGone`; Redis
        away or silent as the typed 503 (the request, which may have joined, becomes an orphan)."""
        try:
            async with asyncio.timeout_at(self.deadline_at + GRACE_S):
                if self.chain:  # its chain is open while any of its calls is (fleet.store.chains)
                    await self._start_chain()
                await self._join()
                assert self.events is not None
                first = await self.client.race(self.events.__anext__())
        except (RedisError, TimeoutError) as e:
            log.error("request %s: Redis unavailable (%s)", self.rid, type(e).__name__)
            await self.end(infer_outcome(e))
            raise self._typed(unavailable_error(e, deadline_ms=self.deadline_ms)) from None
        if isinstance(first, Failed):
            await self.end(infer_outcome(first), in_line=True)
            raise self._typed(from_event(first))
        return first

    async def _start_chain(self) -> None:
        """Count the call open in its chain: refused (409) while the chain is cancelled; judged on
        the smaller of its own deadline and what is left of the chain's (`X-Chain-Deadline-Ms`,
        the first call that sent one set it); a call of a chain under way is not a new chain's."""
        got = await self.gw.chains.start(self.chain, self.spec.tier, self.priority.name, member=self.chain_member,
                                         deadline_ms=self.chain_deadline_ms, owner=self.caller.name)
        if got.cancelled_for_ms is not None:
            raise APIError(409, f"chain {self.chain!r} was cancelled (DELETE /v1/fleet/chains/{{id}}); its new calls "
                           "are refused for a while", "invalid_request_error", param="X-Chain-Id",
                           code="chain_cancelled", headers=retry_headers(got.cancelled_for_ms / 1000, False))
        self.chain_open = True
        self.opens_chain = not got.under_way
        if got.left_ms is not None and got.left_ms < self.deadline_ms:
            self.clock = self.clock.bounded(got.left_ms)
            self.deadline_ms = self.clock.deadline_ms
            self.deadline_at = asyncio.get_running_loop().time() + self.deadline_ms / 1000

    @property
    def chain_member(self) -> str:
        return f"{self.asked_tier}|{self.rid}"

    async def _join(self) -> None:
        """Admission (rate limits, budgets, the tier's drain and the deadline: a typed 429 with
        Retry-After, or a ticket), then the watch, then the line."""
        spec = self.spec
        output = self.gw.admission.views[spec.tier].capacity.output_estimate(spec.explicit_max_tokens)
        weight = self.caller.key.weight if self.caller.key else 1.0
        metrics.DEADLINES.labels(spec.tier, self.clock.source).inc()
        attempt = Attempt(self.identity, self.digest, retry=self.clock.retry, taken_ms=self.deadline_ms)
        got = await self.gw.admission.admit(AdmissionRequest(
            rid=self.rid, caller=self.caller, tier=spec.tier, priority=self.priority, deadline_ms=self.deadline_ms,
            clock=self.clock, prompt_tokens=spec.prompt_tokens, max_tokens=spec.max_tokens,
            expected_output_tokens=output, attempt=attempt, opens_chain=self.opens_chain,
            place=self._place(output, weight)), self)
        if isinstance(got, Joined):
            self.follow(got.rid, got.tier, got.why)
            return
        self.ticket = got
        if got.req.degraded_from:
            self._served_by(got.req.tier, got.req.degraded_from, got.req.degrade_reason, got.req.max_tokens)
            spec = self.spec
        # Watched before it joins the line, so the reader takes the stream in while the enqueue runs
        # (which rings the reader itself when its read in flight must be told: `Watch.wake`).
        self.watch = watch = self.gw.results.watch(self.line, self.rid, ring=False)
        try:
            await self.ticket.enqueue(self.line, spec.payload(self.caller.name), self.chain,
                                      affinity=affinity_key(self.chain, spec.prefix), wake=watch.wake)
        except BaseException:
            watch.ring_apart()
            raise
        self.events = events(self.watch, self.line, self.deadline_at, drop=not self.retryable)

    # --- degrade before shedding (`gateway.degrade.Retarget`) ---------------------------------

    def ask(self, reason: str) -> DegradeAsk:
        key = self.caller.key
        return DegradeAsk(self.spec.tier, reason, self.priority, model=self.spec.body.model, wish=self.degrade_wish,
                          key=key.degrade if key else "tier",
                          key_tiers=frozenset(key.tiers) if key and key.tiers is not None else None)

    def request(self, first: AdmissionRequest, tier: str, reason: str) -> AdmissionRequest | None:
        """The same call for `tier`: its output bound, estimate and fair place there; the retry gate
        passed where it asked. None when its max_tokens is over that tier's limit."""
        tc = self.gw.cfg.tiers[tier]
        max_tokens = self.spec.body.wanted_tokens(default_max_tokens(tc))
        if max_tokens > tc.max_tokens_limit:
            return None
        output = self.gw.admission.views[tier].capacity.output_estimate(self.spec.explicit_max_tokens)
        weight = self.caller.key.weight if self.caller.key else 1.0
        return replace(first, tier=tier, max_tokens=max_tokens, expected_output_tokens=output,
                       attempt=Attempt(taken_ms=self.deadline_ms), place=self._place(output, weight, tier),
                       degraded_from=first.tier, degrade_reason=reason)

    def _served_by(self, tier: str, asked: str, reason: str, max_tokens: int) -> None:
        """Served by `tier` instead of the tier it named: the body kept whole but for its model,
        the target's output bound, its line. Its identity stays the body's as sent, for its SDK's
        retry asks the first tier again and joins it there (`gateway.retry_join.park`)."""
        spec = self.spec
        raw = orjson.loads(spec.raw)
        raw["model"] = tier
        self.spec = replace(spec, tier=tier, raw=orjson.dumps(raw), max_tokens=max_tokens,
                            body=spec.body.model_copy(update={"model": tier}))
        self.line = self.gw.lines[tier]
        self.rec = RequestRecorder(tier, self.priority.name)
        self.degraded_from, self.degrade_reason = asked, reason

    def _place(self, output: int, weight: float, tier: str | None = None) -> Place | None:
        """Where it goes in its class of a fair tier. A call of a chain under way is not a flow that
        is ahead of the others: its chain waits on each call in turn, so what its earlier calls were
        served is forgiven (it starts at the class's clock, as a new chain does) and new chains
        do not pass it; calls of it still waiting keep it behind them."""
        spec = self.spec
        place = fair_place(self.gw.cfg, tier or spec.tier, self.flow, prompt_tokens=spec.prompt_tokens,
                           output_tokens=output, weight=weight)
        if place is not None and self.chain and not self.opens_chain:
            place = replace(place, half_life_s=FORGIVEN_S)
        return place

    def follow(self, rid: str, tier: str = "", why: str = "") -> None:
        """This attempt took over `rid`, the call an earlier attempt of it started and left: read that
        call's events from its first (the owner, `gateway.retry_join.keep_for_retry`, ends it).
        `tier`: the smaller tier that serves it, when the earlier attempt was degraded (for `why`)."""
        log.info("request %s: a retry took it over", rid)
        metrics.RETRIES.labels(self.spec.tier, "joined").inc()
        if tier and tier != self.spec.tier and tier in self.gw.lines:
            self._served_by(tier, self.spec.tier, why, self.spec.max_tokens)
        self.rid, self.joined = rid, True
        self.watch = self.gw.results.watch(self.line, rid, ring=True)
        self.events = events(self.watch, self.line, self.deadline_at, drop=False)

    async def next(self) -> Event:
        """The call's next event after the first (streaming); Redis away raises its error."""
        assert self.events is not None
        return await self.events.__anext__()

    def completed(self, done: Done) -> None:
        """The answer came whole: its histograms now (the end settles the ticket with its usage)."""
        self.rec.done(done)

    # --- the one end --------------------------------------------------------------------------

    async def end(self, told: Outcome, usage: Usage | None = None, *, in_line: bool = False) -> None:
        """End the call once, as its caller was told `told`. A call whose client left while its SDK
        will retry it is parked instead, for the retry to take over (`gateway.retry_join`); its
        owner ends it when it ends. Later calls do nothing."""
        if self.told is not None:
            return
        self.told = told
        self.client.stop()
        in_the_line = self.ticket is not None or self.joined
        if told == Outcome.CANCELLED and self.retryable and in_the_line and not in_line and await retry_join.park(self):
            self.parked = True
            if self.watch is not None:
                self.watch.close()
            if not self.joined:  # the owner reads on to the end; a retry that left again only parks it
                spawn(retry_join.keep_for_retry(self))
            return
        if self.joined:  # a retry that took over another's call: that call's owner ends and counts it
            if self.watch is not None:
                self.watch.close()
            return
        await self.finish(told, usage, in_line=in_line)

    async def finish(self, told: Outcome, usage: Usage | None = None, *, in_line: bool = False) -> None:
        """The call's one end. `in_line`: the line already ended it (a worker's done or failure, the
        deadline's event); else the gateway ends it there now (cancelled, failed), or the orphan
        sweep does once Redis answers again. Then close the ticket and count the outcome."""
        if self.retryable and not self.parked:  # its stream was kept for a retry that will not come
            drop_soon(self.line, self.rid)
        if self.chain_open:  # refused or late unless it completed (a caller hanging up is neither)
            spawn(self.gw.chains.end(self.chain, told not in (Outcome.COMPLETED, Outcome.CANCELLED),
                                     self.chain_member, served=told == Outcome.COMPLETED))
        if self.watch is not None:
            self.watch.close()
        if self.events is not None:
            spawn(close_events(self.events))  # Redis calls of its own: off the caller's path
        if self.ticket is None:  # never reached the line: nothing to end but the count
            self._count(told)
            return
        outcome: Outcome | None = told
        if told == Outcome.UNAVAILABLE:
            outcome = None
        elif not in_line:
            # What the line records is what is counted: a worker may have completed it a moment before.
            outcome = await end_in_line(self.line, self.rid, recorded_in_line(told))
        if outcome is None:  # Redis did not answer: ended there once it does, counted as told
            self.gw.orphans.add(self.line, self.rid, recorded_in_line(told), self.ticket)
            self._count(recorded_in_line(told))
            return
        spawn(self.ticket.close(outcome, usage))
        self._count(outcome)

    def _count(self, outcome: Outcome) -> None:
        metrics.REQUESTS.labels(self.spec.tier, self.priority.name, outcome).inc()

    def _typed(self, err: APIError) -> APIError:
        err.headers.update(self.headers)
        return err


def count_refused(tier: str | None, priority: str | None, cause: BaseException) -> None:
    """fleet_requests_total for a call refused before a `Call` was made (its body, its key): the
    outcome of the refusal that ended it (`fleet.outcome.infer_outcome`)."""
    metrics.REQUESTS.labels(tier or "none", priority or "none", infer_outcome(cause)).inc()

