"""The budget governor's tick: read spend and replicas from Redis, judge each
tier with `fleet.policy.budget.judge`, publish the judgement.

I/O only; the decision is the policy's. Whoever ticks it (the scaler's loop
each tick, and the gateway's background loop so that budgets hold without a
scaler) calls `govern(redis, cfg, now)`. Every tick recomputes from the
ledger and the heartbeats alone, so any number of parts may tick it: they
write the same answer.

What it publishes, per tier, in the `TierKeys.budget` hash (the contract with
admission and the scaler): `exhausted` "1"/"0", `retry_at` (epoch seconds of
the binding window's end, when exhausted; else 0), `window`, `spent`,
`projected`, `budget` (dollars; budget empty when none), `ceiling` (the most
replicas the budget allows, not clamped to max_replicas; empty when the
budget does not bound the count), `capped` ("1" when it is below
max_replicas), `burn_usd_per_h`,
`reason`, `ts`. The hash expires after a few ticks, so a governor that has
stopped leaves no stale refusal: no hash means "not judged", and admission
then admits.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from fleet import metrics as m
from fleet.config import FleetConfig
from fleet.keys import TierKeys
from fleet.latency import cold_start_s
from fleet.ledger import Ledger, Spend
from fleet.policy.budget import (
    BudgetObservation,
    BudgetView,
    active_windows,
    budget_day,
    budget_lead_s,
    cost_per_useful_million,
    judge,
)
from fleet.replicas import read_replicas

log = logging.getLogger("fleet.governor")


@dataclass(slots=True)
class TierBudget:
    """One tier's judgement and the day's spend behind it (for status and metrics)."""

    view: BudgetView
    day: Spend
    day_start: float
    day_end: float
    now: float

    @property
    def cost_per_million_useful_usd(self) -> float:
        return cost_per_useful_million(self.day.usd, self.day.useful_tokens, max(1.0, self.now - self.day_start))


def state_ttl_s(cfg: FleetConfig) -> int:
    """How long a published judgement stays valid without a fresh tick."""
    return max(10, math.ceil(10 * cfg.heartbeat_s))


async def assess(redis: Redis, cfg: FleetConfig, tier: str, now: float) -> TierBudget:
    """Observe one tier and judge it; writes nothing."""
    tc = cfg.tiers[tier]
    keys = TierKeys(cfg.namespace, tier)
    ledger = Ledger(redis, cfg.namespace, tier, tc)
    replicas = await read_replicas(redis, keys, cfg.heartbeat_s, now)
    spent = {w.name: await ledger.spent_usd(w.start, now) for w in active_windows(tc.budget, now)}
    burn = await ledger.token_burn_usd_per_s(now)
    # The start-up the scaler last measured (it publishes it), else the engine model's:
    # windows opening within the lead already bound the ceiling.
    measured = await redis.hget(keys.scaler, "startup_s")
    try:
        startup = float(measured) if measured not in (None, b"", "") else cold_start_s(tc.sim)
    except (TypeError, ValueError):
        startup = cold_start_s(tc.sim)
    view = judge(tc, BudgetObservation(now=now, replicas=len(replicas), spent_usd=spent, token_burn_usd_per_s=burn),
                 lead_s=budget_lead_s(tc, startup))
    day_start, day_end = budget_day(tc.budget, now)
    day = await ledger.window(day_start, now)
    return TierBudget(view, day, day_start, day_end, now)


async def publish(redis: Redis, keys: TierKeys, view: BudgetView, now: float, ttl_s: int) -> None:
    fields = {
        "exhausted": "1" if view.exhausted else "0",
        "retry_at": f"{view.retry_at:.3f}" if view.exhausted and view.retry_at else "0",
        "window": view.window or "",
        "spent": f"{view.spent_usd:.9f}",
        "projected": f"{view.projected_usd:.9f}",
        "budget": "" if view.budget_usd is None else f"{view.budget_usd:.9f}",
        "ceiling": "" if view.ceiling is None else str(view.ceiling),
        "capped": "1" if view.capped else "0",
        "burn_usd_per_h": f"{view.burn_usd_per_s * 3600:.6f}",
        "reason": view.reason,
        "ts": f"{now:.3f}",
    }
    async with redis.pipeline(transaction=True) as p:
        p.hset(keys.budget, mapping=fields)
        p.expire(keys.budget, ttl_s)
        await p.execute()


PRUNE_EVERY_S = 600.0  # how often a governor drops the accrual marks of replicas long gone
_pruned_at: dict[tuple[str, str], float] = {}  # (namespace, tier) -> when this process last pruned


async def prune_marks(redis: Redis, cfg: FleetConfig, tier: str, now: float) -> int:
    """Drop `ledger:beats` marks of replicas silent for an hour (each replica id leaves
    one, and ids are never reused), at most every PRUNE_EVERY_S: without it the hash
    grows for ever. A replica silent that long is charged afresh, capped at MAX_GAP_S."""
    at = _pruned_at.get((cfg.namespace, tier))
    if at is not None and now - at < PRUNE_EVERY_S:
        return 0
    _pruned_at[(cfg.namespace, tier)] = now
    return await Ledger(redis, cfg.namespace, tier, cfg.tiers[tier]).forget_gone(now)


async def govern(redis: Redis, cfg: FleetConfig, now: float | None = None) -> dict[str, BudgetView]:
    """One governor tick over every tier: judge and publish. Returns the views.

    A tier whose ledger cannot be read keeps its last published state until
    that expires; the others are still judged.
    """
    now = time.time() if now is None else now
    ttl = state_ttl_s(cfg)
    out: dict[str, BudgetView] = {}
    for tier in cfg.tiers:
        try:
            await prune_marks(redis, cfg, tier, now)
            tb = await assess(redis, cfg, tier, now)
            await publish(redis, TierKeys(cfg.namespace, tier), tb.view, now, ttl)
            refresh_tier_metrics(tier, tb, [w.name for w in cfg.tiers[tier].budget.windows])
            out[tier] = tb.view
        except Exception:
            log.exception("budget governor tick failed for %s", tier)
    return out


async def read_state(redis: Redis, keys: TierKeys) -> dict[str, str]:
    """The published judgement as strings (empty when none is current)."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in (await redis.hgetall(keys.budget)).items()}


def refresh_tier_metrics(tier: str, tb: TierBudget, configured_windows: list[str]) -> None:
    """Set the budget gauges of one tier from a judgement."""
    m.SPEND.labels(tier).set(tb.day.usd)
    cost = tb.cost_per_million_useful_usd
    m.COST_PER_MTOK.labels(tier).set(cost if math.isfinite(cost) else math.nan)
    active = {w.name for w in tb.view.windows}
    for w in tb.view.windows:
        m.BUDGET.labels(tier, w.name).set(w.budget_usd)
        m.PROJECTED_SPEND.labels(tier, w.name).set(w.projected_usd)
    for name in configured_windows:  # a named window that has closed has no projection
        if name not in active:
            with contextlib.suppress(KeyError):
                m.PROJECTED_SPEND.remove(tier, name)


async def refresh_budget_metrics(redis: Redis, cfg: FleetConfig, now: float | None = None) -> None:
    """Set fleet_spend_usd_total, fleet_budget_usd, fleet_projected_spend_usd and
    fleet_cost_per_million_tokens_usd for every tier (for a /metrics scrape)."""
    now = time.time() if now is None else now
    for tier, tc in cfg.tiers.items():
        refresh_tier_metrics(tier, await assess(redis, cfg, tier, now), [w.name for w in tc.budget.windows])


def _finite(x: float | None, digits: int = 6) -> float | None:
    """JSON has no infinity: an unbounded figure is reported as null."""
    return None if x is None or not math.isfinite(x) else round(x, digits)


async def budget_status(redis: Redis, cfg: FleetConfig, tier: str, now: float | None = None) -> dict[str, Any]:
    """A tier's spend and budget for /v1/fleet/status: today's spend (the budget day),
    projected spend, budget and the ceiling it allows, replica-hours by state,
    tokens, and the cost per million useful tokens."""
    now = time.time() if now is None else now
    tb = await assess(redis, cfg, tier, now)
    v, day = tb.view, tb.day
    lifetime = await Ledger(redis, cfg.namespace, tier, cfg.tiers[tier]).totals()
    return {
        "spend_usd": round(day.usd, 6),
        "projected_spend_usd": round(v.projected_usd, 6) if v.budget_usd is not None else None,
        "budget_usd": v.budget_usd,
        "budget_ceiling": v.ceiling,
        "replica_hours": {**{s: round(h / 3600, 6) for s, h in day.replica_s.items()},
                          "total": round(day.replica_hours, 6)},
        "cost_per_million_useful_tokens_usd": _finite(tb.cost_per_million_useful_usd),
        "budget": {
            "exhausted": v.exhausted, "window": v.window, "retry_at": v.retry_at, "capped": v.capped,
            "burn_usd_per_hour": round(v.burn_usd_per_s * 3600, 6), "reason": v.reason,
            "day": {"start": tb.day_start, "end": tb.day_end},
            "windows": [{"name": w.name, "start": w.start, "end": w.end, "budget_usd": w.budget_usd,
                         "spent_usd": round(w.spent_usd, 6), "projected_usd": round(w.projected_usd, 6),
                         "ceiling": w.ceiling, "exhausted": w.exhausted} for w in v.windows],
        },
        "tokens_today": {"total": day.tokens, "completion": day.completion_tokens, "useful": day.useful_tokens,
                         "token_usd": round(day.token_usd, 6)},
        "spend_lifetime_usd": round(lifetime.usd, 6),
    }
