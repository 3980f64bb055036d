"""What an admitted call holds until it ends: its reservations, its ticket, and the typed refusal.

The admission sequence (`gateway.admission`) runs the reservation steps
(`gateway.key_limits`) and the tier decision; every step that takes something
(a place in a rate window, dollars of a key's budget) returns a `Reservation`.
The `Ticket` holds them all and ends each exactly once: `settle` with the real
usage when the request completed, `release` when it was refused further on,
expired, was cancelled or failed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from redis.asyncio import Redis

from fleet.config import Priority
from fleet.outcome import Outcome
from fleet.policy.client_clock import CallClock, should_retry
from fleet.store.admitting import Attempt
from fleet.store.flows import Place
from fleet.store.line import Line
from fleet.store.replication import Ack
from gateway.auth import Caller
from gateway.errors import APIError, retry_headers

log = logging.getLogger("fleet.gateway.admission")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What the admission sequence knows about one call."""

    rid: str
    caller: Caller
    tier: str
    priority: Priority
    deadline_ms: int
    clock: CallClock  # what its deadline bounds and what admission judges (`fleet.policy.client_clock`)
    prompt_tokens: int  # estimated before any tokenizer runs
    max_tokens: int
    expected_output_tokens: int
    place: Place | None = None  # its flow and cost in a fair tier (`gateway.call_spec.fair_place`)
    attempt: Attempt = field(default_factory=Attempt)  # who it is for the retry gate (`fleet.store.retries`)
    opens_chain: bool = False  # the first call of a new chain: shed before chains under way
    degraded_from: str = ""  # the tier the caller asked for, which refused it (`gateway.degrade`)
    degrade_reason: str = ""  # that tier's refusal

    @property
    def estimated_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


class Reservation(Protocol):
    """Something a step took for a request; the ticket ends it exactly once."""

    async def settle(self, usage: Usage) -> None:
        """The request completed: replace what was reserved with what it really used."""

    async def release(self) -> None:
        """The request never ran to completion (refused later, expired, cancelled, failed): give it all back."""


class ReservationStep(Protocol):
    """One step of the sequence before the tier decision. Raise `refusal(...)` to refuse;
    return a Reservation (or None if nothing was taken) to go on."""

    name: str

    async def reserve(self, req: AdmissionRequest) -> Reservation | None: ...


# Outcomes after which an engine may have made tokens the gateway never saw: charged what was
# reserved when an engine took the call (`Ticket.close`).
CHARGED_IF_TAKEN = frozenset({Outcome.COMPLETED, Outcome.CANCELLED, Outcome.EXPIRED})

# Refusals no retry soon can turn around: the caller's SDK is told not to retry them.
FINAL_CODES = frozenset({"budget_exhausted", "key_budget_exhausted", "retry_budget_exhausted"})


def refusal(code: str, message: str, req: AdmissionRequest, retry_after_s: float, *, final: bool = False,
            busy_s: float = 0.0, starting: int = 0) -> APIError:
    """The typed 429 of the contract: Retry-After in whole seconds (>= 1) and retry-after-ms, and
    `x-should-retry` (`fleet.policy.client_clock.should_retry`: `busy_s` and `starting`, what
    admission observed of the tier's line, say whether it is in a sustained overload); body with
    tier, priority, retry_after_s."""
    secs = max(1, math.ceil(retry_after_s - 1e-9))
    again = should_retry(retry_after_s=secs, retryable=not final and code not in FINAL_CODES,
                         attempts_left=req.clock.attempts_left, busy_s=busy_s, starting=starting)
    return APIError(429, message, "at_capacity", code=code, headers=retry_headers(secs, again),
                    tier=req.tier, priority=req.priority.name, retry_after_s=secs)


@dataclass
class Ticket:
    """An admitted request's reservations and its mark in the tier's `admitting` set."""

    req: AdmissionRequest
    redis: Redis
    admitting_key: str
    member: str
    request_key: str  # the request's hash in the line: did an engine ever take it?
    ack: Ack | None = None  # replicas that must hold the enqueue before the call goes on
    reservations: list[Reservation] = field(default_factory=list)
    closed: bool = False

    async def enqueue(self, line: Line, payload: bytes, chain: str = "", *, affinity: str = "",
                      wake: bytes | None = None) -> int:
        """Join the line and drop the being-admitted mark in one step (the line now counts it).

        If this fails the request may still have joined (a frozen Redis runs the
        script when it wakes): the caller ends it as an orphan (`gateway.redis_loss`),
        which also ends this ticket; the being-admitted mark expires by itself."""
        return await line.enqueue(self.req.rid, self.req.priority, payload, self.req.deadline_ms, chain,
                                  admitting=(self.admitting_key, self.member), ack=self.ack, affinity=affinity,
                                  place=self.req.place, wake=wake, deadline_source=self.req.clock.source)

    async def close(self, outcome: Outcome | None, usage: Usage | None = None) -> None:
        """End the request's reservations once, by its outcome. Later calls do nothing.

        Completed: settle with the real usage (without it, as below). Cancelled or expired after an engine
        took it: the engine made tokens the gateway cannot count, so settle at the
        worst case reserved (otherwise hanging up just before the end would make
        any call free for the key's budget and limits). Anything else (refused,
        never claimed, failed by the fleet): release.
        """
        if self.closed:
            return
        self.closed = True
        settle_with = usage if outcome == Outcome.COMPLETED else None
        # A call that completed just as its caller hung up ends with no usage seen: like a cancel
        # after an engine took it, it is charged what was reserved, never nothing.
        if settle_with is None and outcome in CHARGED_IF_TAKEN and self.reservations:
            attempt = await self.redis.hget(self.request_key, "attempt")
            if attempt is not None and int(attempt) > 0:
                settle_with = Usage(self.req.prompt_tokens, self.req.max_tokens)
        await end_all(self.reservations, settle_with)


async def end_all(reservations: Sequence[Reservation], usage: Usage | None) -> None:
    for r in reversed(reservations):
        try:
            if usage is not None:
                await r.settle(usage)
            else:
                await r.release()
        except Exception:  # one step's Redis blip must not keep the others from ending
            log.exception("could not end reservation %r", r)

