"""The gateway's admission sequence, run for every call before it joins its tier's line:

    auth (gateway.auth) -> reservation steps (the key's rpm/tpm and dollar
    budget, gateway.key_limits) -> the tier's admission decision
    (fleet.policy.admission) -> join the line

A refusal anywhere releases what the earlier steps took; an admitted call
gets a `Ticket` (gateway.tickets) that ends its reservations once.

The tier decision reads the line, the completions, the budget judgement and the
requests being admitted right now in ONE round trip (`fleet.store.admitting`),
and marks this request as being admitted in the same step, so a burst of
concurrent calls sees each other instead of all reading the same empty line.
The tier view (its replicas, and its capacity as the scaler calibrated it)
changes at heartbeat pace and is cached. The decision itself is the policy's
(`fleet.policy.observation.judge_admission`), on the same `TierObservation`
the simulator builds for each of its calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from fleet import metrics
from fleet.config import FleetConfig
from fleet.observe import observed
from fleet.policy import (
    AdmissionInput,
    BudgetSignal,
    Calibration,
    Replicas,
    TierCapacity,
    calibrated_capacity,
    judge_admission,
    modelled_startup_s,
    observe_tier,
    startup_estimate,
    tier_capacity,
)
from fleet.policy.degrade import rules_of
from fleet.policy.fairness import fair_line
from fleet.policy.replicas import NO_REPLICAS
from fleet.store.admitting import Admitting, Gated, RetryBudget
from fleet.store.capacity import read_calibration
from fleet.store.heartbeats import read_heartbeats
from fleet.store.keys import TierKeys
from fleet.store.line import Line
from fleet.store.replication import Ack
from fleet.store.retries import JOINED, OTHER_BODY, Retries
from fleet.tasks import cancel_and_wait, spawn
from gateway.degrade import Retarget, degraded
from gateway.errors import APIError
from gateway.key_limits import KeyBudgetStep, RateLimitStep
from gateway.redis_loss import caller_id
from gateway.tickets import (
    AdmissionRequest,
    Reservation,
    ReservationStep,
    Ticket,
    Usage,
    end_all,
    refusal,
)

__all__ = ["Admission", "AdmissionRequest", "Ticket", "TierView", "Usage", "refusal"]

log = logging.getLogger("fleet.gateway.admission")


@dataclass(frozen=True, slots=True)
class TierView:
    """What admission keeps of a tier between heartbeats: its replicas and what one is assumed to do."""

    capacity: TierCapacity
    replicas: Replicas = NO_REPLICAS


# A refused attempt's retry is invited for its Retry-After and this long more: the SDK's backoff
# jitter and a loaded client.
INVITED_SLACK_MS = 10_000


@dataclass(frozen=True, slots=True)
class Joined:
    """This attempt took over `rid`, the call an earlier attempt of it started and left; `tier`
    holds it when another tier than the one asked serves it (degraded, for `why`)."""

    rid: str
    tier: str = ""
    why: str = ""


def gated(g: Gated, req: AdmissionRequest) -> Joined:
    """The retry gate's answer: the call taken over, or the typed refusal (the retry budget spent:
    429 with `x-should-retry: false`; an Idempotency-Key with another body: 422)."""
    if g.verdict == JOINED:
        return Joined(g.rid, g.tier, g.why)
    if g.verdict == OTHER_BODY:
        raise APIError(422, "this Idempotency-Key was sent with another body by a call still kept for its retry; "
                       "a retry must send the same body, a new call a new key", param="Idempotency-Key",
                       code="idempotency_key_reused")
    metrics.RETRIES.labels(req.tier, "budget_refused").inc()
    raise refusal("retry_budget_exhausted", f"the tier {req.tier!r} is spending its retry budget: retries that "
                  "join no call still running are admitted up to a share of first attempts "
                  "(client_clock.retry_budget); this retry is not", req, 1, final=True)


class Admission:
    def __init__(self, cfg: FleetConfig, redis: Redis, lines: dict[str, Line]) -> None:
        self.cfg = cfg
        self.redis = redis
        self.lines = lines
        for line in lines.values():  # what joins them is recorded as this process's to answer for
            line.caller = caller_id()
        self.keys = {t: TierKeys(cfg.namespace, t) for t in cfg.tiers}
        # Steps run in order before the tier decision; each may refuse.
        self.steps: list[ReservationStep] = [RateLimitStep(cfg, redis), KeyBudgetStep(cfg, redis)]
        self.views: dict[str, TierView] = {t: TierView(tier_capacity(tc)) for t, tc in cfg.tiers.items()}
        self.admitting = Admitting(redis)
        self.rules = rules_of(cfg.tiers) if any(tc.degrade for tc in cfg.tiers.values()) else {}
        self.retries = Retries(redis)
        b = cfg.client_clock.retry_budget
        self.retry_budget = RetryBudget(b.ratio, max(1, math.ceil(b.window_s)), b.min_per_s)
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle ---

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)  # not a lone cancel(): one lost in a Redis call hangs the exit

    async def refresh(self) -> None:
        """Each tier's replicas, and its capacity as the scaler calibrated it; with no scaler
        publishing, the start-up the replicas' engines measured, else the profile's."""
        stale = max(10.0, 10 * self.cfg.heartbeat_s)
        for tier, tc in self.cfg.tiers.items():
            k = self.keys[tier]
            beats = await read_heartbeats(self.redis, k, self.cfg.heartbeat_s)
            cal = await read_calibration(self.redis, k, stale_after_s=stale)
            if cal is None:
                engine = [b.cold_start_s for b in beats if b.cold_start_s is not None]
                cal = Calibration(startup_s=startup_estimate((), engine, modelled_startup_s(tc)))
            self.views[tier] = TierView(calibrated_capacity(tc, cal), Replicas.of(observed(b) for b in beats))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("replica refresh failed")

    # --- the sequence ---

    async def admit(self, req: AdmissionRequest, retarget: Retarget | None = None) -> Ticket | Joined:
        """Run the reservation steps and the tier decision; a Ticket, the call a retry took over
        (`Joined`: what was reserved for it is given back, the call it joined holds its own), or
        the typed 429. Refused, a call with `retarget` may be served by a smaller tier instead
        (`gateway.degrade`): only a refusal pays for that look."""
        try:
            return await self._admit_at(req)
        except APIError as e:
            if e.status == 429:
                if retarget is not None and self.rules:
                    got = await degraded(req, e, retarget, self.rules, self._admit_degraded, self.redis,
                                         self.cfg.namespace)
                    if got is not None:
                        return got
                self._shed(req, e)
            raise

    def _shed(self, req: AdmissionRequest, e: APIError) -> None:
        """A 429 its caller is told: counted (its outcome, shed, by its `Call`), and the retry it
        asks for invited: it spends no retry budget."""
        metrics.SHED.labels(req.tier, req.priority.name, e.code or "at_capacity").inc()
        if req.attempt.identity and e.headers.get("x-should-retry") == "true":
            wait_ms = int(e.headers.get("retry-after-ms", "1000")) + INVITED_SLACK_MS
            spawn(self.retries.refused(self.keys[req.tier], req.attempt.identity, req.attempt.digest, wait_ms))

    async def _admit_degraded(self, req: AdmissionRequest) -> Ticket:
        got = await self._admit_at(req)
        assert isinstance(got, Ticket)  # its attempt joins nothing: it passed the retry gate where it asked
        return got

    async def _admit_at(self, req: AdmissionRequest) -> Ticket | Joined:
        """One tier's whole sequence: the reservation steps, then its decision; what was taken is
        given back on a refusal."""
        taken: list[Reservation] = []
        try:
            for step in self.steps:
                r = await step.reserve(req)
                if r is not None:
                    taken.append(r)
            ticket = await self._tier_decision(req)
            if isinstance(ticket, Joined):
                await end_all(taken, None)
                return ticket
        except APIError:
            await end_all(taken, None)
            raise
        except BaseException:
            # Redis away or the deadline's bound reached: releasing must not hold the caller's
            # answer (each call could wait out its read timeout), so it runs on its own.
            spawn(end_all(taken, None))
            raise
        ticket.reservations = taken
        return ticket

    async def _tier_decision(self, req: AdmissionRequest) -> Ticket | Joined:
        """The tier's admission decision on one round trip's view (marking this call as being
        admitted) and the cached replicas and capacity; a Ticket, or the typed 429. First the
        retry gate: the call this attempt takes over, or the retry budget's refusal."""
        tc = self.cfg.tiers[req.tier]
        k = self.keys[req.tier]
        member = f"{int(req.priority)}:{req.rid}"
        window_s = self.cfg.rate_window_s
        snap = await self.admitting.observe_and_mark(k, self.lines[req.tier].prefix, member, int(window_s * 1000),
                                                     (int(req.priority), req.place) if req.place else None,
                                                     req.attempt, self.retry_budget)
        if isinstance(snap, Gated):
            return gated(snap, req)
        view = self.views[req.tier]
        # In a fair tier only what the line will put before it counts, not its whole class.
        ahead = None if snap.ahead_in_class is None else snap.ahead_in_class + snap.admitting[req.priority]
        obs = observe_tier(
            req.tier, time.time(), window_s, line=fair_line(snap.line, req.priority, ahead),
            in_flight=snap.in_flight, completions_in_window=snap.completions_in_window,
            busy_s=snap.busy_ms / 1000, completions_while_busy=snap.completions_while_busy, replicas=view.replicas,
            budget=BudgetSignal(snap.budget_exhausted, snap.budget_retry_at))
        decision = judge_admission(AdmissionInput.for_tier(
            obs, view.capacity, tc, req.priority, prompt_tokens=req.prompt_tokens,
            output_tokens=req.expected_output_tokens, deadline_s=req.clock.judged_ms / 1000,
            first_token=req.clock.first_token,
            patience_s=None if req.clock.patience_ms is None else req.clock.patience_ms / 1000,
            opens_chain=req.opens_chain,
            class_ahead=None if ahead is None else sum(snap.line[: int(req.priority) + 1])))
        if not decision.admitted:
            with contextlib.suppress(Exception):
                await self.admitting.unmark(k, member)
            raise refusal(decision.reason or "drain_exceeded", decision.message, req, decision.retry_after_s,
                          final=decision.final, busy_s=obs.busy_s, starting=obs.replicas.starting)
        rep = self.cfg.replication
        ack = Ack(rep.ack_replicas, rep.ack_timeout_ms) if rep.waits(req.priority.name) else None
        return Ticket(req, self.redis, k.admitting, member, k.request(req.rid), ack)
