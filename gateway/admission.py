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
The replica view (ready, starting, measured cold start) changes at heartbeat
pace and is cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from fleet import metrics
from fleet.config import FleetConfig
from fleet.latency import cold_start_s, per_replica_rate
from fleet.policy import admit as decide_admission
from fleet.policy import expected_service_s, expected_startup_s, service_forecast
from fleet.store.admitting import Admitting
from fleet.store.heartbeats import read_heartbeats
from fleet.store.keys import TierKeys
from fleet.store.line import Line
from gateway.errors import APIError
from gateway.key_limits import KeyBudgetStep, RateLimitStep
from gateway.tickets import (
    AdmissionRequest,
    Reservation,
    ReservationStep,
    Ticket,
    Usage,
    end_all,
    outcome_of,
    refusal,
)

__all__ = ["Admission", "AdmissionRequest", "ReplicaView", "Ticket", "Usage", "estimate_prompt_tokens", "outcome_of",
           "refusal"]

log = logging.getLogger("fleet.gateway.admission")


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
        # Steps run in order before the tier decision; each may refuse.
        self.steps: list[ReservationStep] = [RateLimitStep(cfg, redis), KeyBudgetStep(cfg, redis)]
        self.replicas: dict[str, ReplicaView] = {
            t: ReplicaView(startup_s=cold_start_s(tc.sim)) for t, tc in cfg.tiers.items()}
        self.admitting = Admitting(redis)
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
            reps = await read_heartbeats(self.redis, self.keys[tier], self.cfg.heartbeat_s)
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
            await end_all(taken, None)
            if e.status == 429:
                metrics.SHED.labels(req.tier, req.priority.name, e.code or "at_capacity").inc()
                metrics.REQUESTS.labels(req.tier, req.priority.name, "shed").inc()
            raise
        except BaseException:
            await end_all(taken, None)
            raise
        ticket.reservations = taken
        return ticket

    async def _tier_decision(self, req: AdmissionRequest) -> Ticket:
        tc = self.cfg.tiers[req.tier]
        k = self.keys[req.tier]
        member = f"{int(req.priority)}:{req.rid}"
        line = self.lines[req.tier]
        window_ms = int(self.cfg.rate_window_s * 1000)
        snap = await self.admitting.observe_and_mark(k, line.prefix, member, window_ms)
        now_ms = snap.now_ms
        busy_ms, comp_window, comp_busy = snap.busy_ms, snap.completions_in_window, snap.completions_while_busy
        exhausted = snap.budget_exhausted
        retry_at = snap.budget_retry_at

        ahead = sum(snap.line[: req.priority + 1])
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
            budget_retry_in_s=retry_at - now_ms / 1000 if retry_at else None,
        )
        if not decision.admitted:
            with contextlib.suppress(Exception):
                await self.admitting.unmark(k, member)
            raise refusal(decision.reason or "drain_exceeded", decision.message, req, decision.retry_after_s)
        return Ticket(req, self.redis, k.admitting, member, k.request(req.rid))


def estimate_prompt_tokens(payload: dict[str, Any]) -> int:
    """Prompt tokens before any tokenizer runs: about four characters a token, as the sim counts them."""
    if payload.get("messages") is not None:
        chars = sum(len(str(m.get("role", ""))) + len(str(m.get("content") or "")) + 3 for m in payload["messages"])
    else:
        chars = len(str(payload.get("prompt") or ""))
    return max(1, (chars + 3) // 4)
