"""The gateway's admission sequence, run for every call before it joins its tier's line:

    auth (gateway.auth) -> reservation steps (per-key rpm/tpm; the per-key dollar
    budget plugs in here) -> the tier's admission decision (fleet.policy.admission)
    -> join the line

Every step that takes something (a place in a rate window, dollars of a key's
budget) returns a `Reservation`; the `Ticket` that comes out of `admit` holds
them all and ends each exactly once: `settle` with the real usage when the
request completed, `release` when it was refused further on, expired, was
cancelled or failed. A refusal anywhere releases what the earlier steps took.

The tier decision reads the line, the completions, the budget state and the
requests being admitted right now in ONE Lua call, and marks this request as
being admitted in the same call, so a burst of concurrent calls sees each
other instead of all reading the same empty line. The replica view (ready,
starting, measured cold start) changes at heartbeat pace and is cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis

from fleet import metrics
from fleet.config import FleetConfig, Priority
from fleet.keys import TierKeys
from fleet.latency import cold_start_s, per_replica_rate
from fleet.line import LUA_BY_CLASS, LUA_NOW, Line
from fleet.policy import admit as decide_admission
from fleet.policy import expected_service_s, expected_startup_s, service_forecast
from fleet.ratelimit import Limited, RateLimiter, Taken
from fleet.replicas import read_replicas
from gateway.auth import Caller
from gateway.errors import APIError

log = logging.getLogger("fleet.gateway.admission")

# How long a "being admitted" mark lives if its gateway dies between the decision and the line.
ADMITTING_HOLD_MS = 5000

# KEYS: line completions budget admitting ; ARGV: window_ms prefix member hold_ms
# Returns: now_ms, waiting by class (4), being admitted by class (4), busy_ms,
#          completions in window, completions while busy, budget exhausted, budget retry_at
OBSERVE_AND_MARK = LUA_NOW + LUA_BY_CLASS + """
local out = {n2s(now), by_class[1], by_class[2], by_class[3], by_class[4]}
local oldest = oldest_enq
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', n2s(now))
local pend = {0, 0, 0, 0}
for _, m in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
  local r = tonumber(string.sub(m, 1, 1)) + 1
  pend[r] = pend[r] + 1
end
for r = 1, 4 do out[#out + 1] = pend[r] end
redis.call('ZADD', KEYS[4], n2s(now + tonumber(ARGV[4])), ARGV[3])
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[4]) * 2)
local busy = now - oldest
local window = tonumber(ARGV[1])
out[#out + 1] = n2s(busy)
out[#out + 1] = redis.call('ZCOUNT', KEYS[2], n2s(now - window), '+inf')
out[#out + 1] = redis.call('ZCOUNT', KEYS[2], n2s(now - math.min(busy, window)), '+inf')
local b = redis.call('HMGET', KEYS[3], 'exhausted', 'retry_at')
out[#out + 1] = b[1] or '0'
out[#out + 1] = b[2] or ''
return out
"""


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
    prompt_tokens: int  # estimated before any tokenizer runs
    max_tokens: int
    expected_output_tokens: int

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


def refusal(code: str, message: str, req: AdmissionRequest, retry_after_s: float) -> APIError:
    """The typed 429 of the contract: Retry-After in whole seconds (>= 1), body with tier, priority, retry_after_s."""
    secs = max(1, math.ceil(retry_after_s - 1e-9))
    return APIError(429, message, "at_capacity", code=code, headers={"Retry-After": str(secs)},
                    tier=req.tier, priority=req.priority.name, retry_after_s=secs)


# --- per-key requests and tokens per minute ---------------------------------------------------------


@dataclass(slots=True)
class _RateReservation:
    limiter: RateLimiter
    taken: Taken

    async def settle(self, usage: Usage) -> None:
        await self.limiter.settle(self.taken, usage.total)

    async def release(self) -> None:
        await self.limiter.release(self.taken)


class RateLimitStep:
    name = "rate_limit"

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter

    async def reserve(self, req: AdmissionRequest) -> Reservation | None:
        key = req.caller.key
        if key is None or (key.rpm is None and key.tpm is None):
            return None  # nothing to count: no round trip
        got = await self.limiter.reserve(key.name, rpm=key.rpm, tpm=key.tpm, tokens=req.estimated_tokens)
        if isinstance(got, Limited):
            what = (f"{key.rpm} requests per minute" if got.limit == "rpm"
                    else f"{key.tpm} tokens per minute (this request may use {req.estimated_tokens})")
            raise refusal("rate_limited", f"API key {key.name!r} is over its limit of {what}", req,
                          got.retry_after_s)
        return _RateReservation(self.limiter, got)


# --- the ticket --------------------------------------------------------------------------------------


@dataclass
class Ticket:
    """An admitted request's reservations and its mark in the tier's `admitting` set."""

    req: AdmissionRequest
    redis: Redis
    admitting_key: str
    member: str
    request_key: str  # the request's hash in the line: did an engine ever take it?
    reservations: list[Reservation] = field(default_factory=list)
    closed: bool = False

    async def enqueue(self, line: Line, payload: bytes, chain: str = "") -> int:
        """Join the line and drop the being-admitted mark in one step (the line now counts it)."""
        try:
            return await line.enqueue(self.req.rid, self.req.priority, payload, self.req.deadline_ms, chain,
                                      admitting=(self.admitting_key, self.member))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.redis.zrem(self.admitting_key, self.member)
            await self.close(None)
            raise

    async def close(self, outcome: str | None, usage: Usage | None = None) -> None:
        """End the request once: count its outcome and end every reservation. Later calls do nothing.

        Completed: settle with the real usage. Cancelled or expired after an engine
        took it: the engine made tokens the gateway cannot count, so settle at the
        worst case reserved (otherwise hanging up just before the end would make
        any call free for the key's budget and limits). Anything else (refused,
        never claimed, failed by the fleet): release.
        """
        if self.closed:
            return
        self.closed = True
        if outcome is not None:
            metrics.REQUESTS.labels(self.req.tier, self.req.priority.name, outcome).inc()
        settle_with = usage if outcome == "completed" else None
        if outcome in ("cancelled", "expired") and self.reservations:
            attempt = await self.redis.hget(self.request_key, "attempt")
            if attempt is not None and int(attempt) > 0:
                settle_with = Usage(self.req.prompt_tokens, self.req.max_tokens)
        await _end(self.reservations, settle_with)


async def _end(reservations: Sequence[Reservation], usage: Usage | None) -> None:
    for r in reversed(reservations):
        try:
            if usage is not None:
                await r.settle(usage)
            else:
                await r.release()
        except Exception:  # one step's Redis blip must not keep the others from ending
            log.exception("could not end reservation %r", r)


def outcome_of(ev: dict[str, Any]) -> str:
    """The outcome a final event stands for."""
    if ev.get("t") == "done":
        return "completed"
    return "expired" if ev.get("type") == "deadline_exceeded" else "failed"


# --- replicas, as admission needs them ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaView:
    ready: int = 0
    starting_since: tuple[float, ...] = ()  # epoch seconds each starting replica began
    startup_s: float = 0.0  # expected cold start: measured median, else modelled


class Admission:
    def __init__(self, cfg: FleetConfig, redis: Redis, lines: dict[str, Line]) -> None:
        self.cfg = cfg
        self.redis = redis
        self.lines = lines
        self.keys = {t: TierKeys(cfg.namespace, t) for t in cfg.tiers}
        self.limiter = RateLimiter(redis, cfg.namespace)
        # Steps run in order before the tier decision; each may refuse. The per-key
        # dollar budget (issue 4, `key_budget_exhausted`) appends its step here.
        from gateway.budget import KeyBudgetStep  # here, not at the top: it imports this module

        self.steps: list[ReservationStep] = [RateLimitStep(self.limiter), KeyBudgetStep(cfg, redis)]
        self.replicas: dict[str, ReplicaView] = {
            t: ReplicaView(startup_s=cold_start_s(tc.sim)) for t, tc in cfg.tiers.items()}
        self._observe = redis.register_script(OBSERVE_AND_MARK)
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle ---

    async def start(self) -> None:
        await self.refresh_replicas()
        self._task = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh_replicas(self) -> None:
        for tier, tc in self.cfg.tiers.items():
            reps = await read_replicas(self.redis, self.keys[tier], self.cfg.heartbeat_s)
            self.replicas[tier] = ReplicaView(
                ready=sum(r.state == "ready" for r in reps),
                starting_since=tuple(r.started for r in reps if r.state == "starting"),
                startup_s=expected_startup_s([r.cold_start_s for r in reps if r.cold_start_s is not None],
                                             cold_start_s(tc.sim)))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            try:
                await self.refresh_replicas()
            except Exception:
                log.exception("replica refresh failed")

    # --- the sequence ---

    async def admit(self, req: AdmissionRequest) -> Ticket:
        """Run the reservation steps and the tier decision; a Ticket, or the typed 429."""
        taken: list[Reservation] = []
        try:
            for step in self.steps:
                r = await step.reserve(req)
                if r is not None:
                    taken.append(r)
            ticket = await self._tier_decision(req)
        except APIError as e:
            await _end(taken, None)
            if e.status == 429:
                metrics.SHED.labels(req.tier, req.priority.name, e.code or "at_capacity").inc()
                metrics.REQUESTS.labels(req.tier, req.priority.name, "shed").inc()
            raise
        except BaseException:
            await _end(taken, None)
            raise
        ticket.reservations = taken
        return ticket

    async def _tier_decision(self, req: AdmissionRequest) -> Ticket:
        tc = self.cfg.tiers[req.tier]
        k = self.keys[req.tier]
        member = f"{int(req.priority)}:{req.rid}"
        line = self.lines[req.tier]
        window_ms = int(self.cfg.rate_window_s * 1000)
        raw = await self._observe(keys=[k.line, k.completions, k.budget, k.admitting],
                                  args=[window_ms, line.prefix, member, ADMITTING_HOLD_MS])
        now_ms = int(raw[0])
        waiting = [int(x) for x in raw[1:5]]
        admitting = [int(x) for x in raw[5:9]]
        busy_ms, comp_window, comp_busy = int(raw[9]), int(raw[10]), int(raw[11])
        exhausted = _s(raw[12]) == "1"
        retry_at = _s(raw[13])

        ahead = sum(waiting[: req.priority + 1]) + sum(admitting[: req.priority + 1])
        view = self.replicas[req.tier]
        now = time.time()
        forecast = service_forecast(
            ready=view.ready,
            starting_left_s=[since + view.startup_s - now for since in view.starting_since],
            per_replica_rate=per_replica_rate(tc.sim, tc.slots),
            startup_s=view.startup_s,
            completions_in_window=comp_window,
            window_s=self.cfg.rate_window_s,
            busy_s=min(busy_ms, window_ms) / 1000,
            completions_while_busy=comp_busy,
        )
        decision = decide_admission(
            req.priority, ahead=ahead, forecast=forecast,
            service_s=expected_service_s(tc, req.prompt_tokens, req.expected_output_tokens),
            wait_limit_s=tc.wait_limit(req.priority), deadline_s=req.deadline_ms / 1000,
            budget_exhausted=exhausted,
            budget_retry_in_s=float(retry_at) - now_ms / 1000 if retry_at else None,
        )
        if not decision.admitted:
            with contextlib.suppress(Exception):
                await self.redis.zrem(k.admitting, member)
            raise refusal(decision.reason or "drain_exceeded", decision.message, req, decision.retry_after_s)
        return Ticket(req, self.redis, k.admitting, member, k.request(req.rid))


def estimate_prompt_tokens(payload: dict[str, Any]) -> int:
    """Prompt tokens before any tokenizer runs: about four characters a token, as the sim counts them."""
    if payload.get("messages") is not None:
        chars = sum(len(str(m.get("role", ""))) + len(str(m.get("content") or "")) + 3 for m in payload["messages"])
    else:
        chars = len(str(payload.get("prompt") or ""))
    return max(1, (chars + 3) // 4)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
