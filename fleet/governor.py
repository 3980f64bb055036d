"""The tier budget governor's tick: observe spend and replicas in Redis, judge each tier with
`fleet.policy.tier_budget.judge`, publish the judgement (`fleet.store.tier_budget`).

I/O only; the decision is the policy's. It runs once per fleet: the scaler that
holds the leader lease ticks it each tick; while no scaler holds the lease (a
fleet of `fleet gateway` and `fleet worker` only), the gateways tick it each
heartbeat instead, so budgets hold either way. Every tick recomputes from the
ledger and the heartbeats alone, so two parts ticking it at once (a gateway
that has not yet seen a new leader) write the same answer.

Everyone else reads what it published: admission (exhausted, retry_at), the
scaler (the ceiling), /v1/fleet/status and /metrics (the judgement and the
spend behind it). The judgement expires after a few ticks (`state_ttl_s`), so a
governor that stopped leaves no stale refusal.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

from redis.asyncio import Redis

from fleet import metrics as m
from fleet.config import FleetConfig
from fleet.policy.tier_budget import (
    BudgetObservation,
    active_windows,
    budget_day,
    budget_lead_s,
    cost_per_useful_million,
    judge,
    token_burn_since,
    token_burn_usd_per_s,
)
from fleet.policy.tier_capacity import modelled_startup_s
from fleet.store.capacity import read_calibration
from fleet.store.heartbeats import read_heartbeats
from fleet.store.keys import TierKeys
from fleet.store.ledger import Ledger
from fleet.store.tier_budget import BudgetState, publish_budget_state

log = logging.getLogger("fleet.governor")


def state_ttl_s(cfg: FleetConfig) -> int:
    """How long a published judgement stays valid without a fresh tick."""
    return max(10, math.ceil(10 * cfg.heartbeat_s))


async def assess(redis: Redis, cfg: FleetConfig, tier: str, now: float) -> BudgetState:
    """Observe one tier and judge it; writes nothing."""
    tc = cfg.tiers[tier]
    keys = TierKeys(cfg.namespace, tier)
    ledger = Ledger(redis, cfg.namespace, tier, tc)
    replicas = await read_heartbeats(redis, keys, cfg.heartbeat_s, now)
    spent = {w.name: await ledger.spent_usd(w.start, now) for w in active_windows(tc.budget, now)}
    burn = token_burn_usd_per_s(await ledger.token_usd_since(token_burn_since(now), now), now)
    # The start-up the scaler last calibrated (it publishes it), else the profile's:
    # windows opening within the lead already bound the ceiling.
    cal = await read_calibration(redis, keys, stale_after_s=None)
    startup = cal.startup_s if cal is not None else modelled_startup_s(tc)
    view = judge(tc, BudgetObservation(now=now, replicas=len(replicas), spent_usd=spent, token_burn_usd_per_s=burn),
                 lead_s=budget_lead_s(tc, startup))
    day_start, day_end = budget_day(tc.budget, now)
    day = await ledger.window(day_start, now)
    lifetime = await ledger.totals()
    return BudgetState(view=view, day=day, day_start=day_start, day_end=day_end, lifetime_usd=lifetime.usd,
                       cost_per_million_useful_usd=cost_per_useful_million(day.usd, day.useful_tokens,
                                                                           max(1.0, now - day_start)),
                       judged_at=now)


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


async def govern(redis: Redis, cfg: FleetConfig, now: float | None = None) -> dict[str, BudgetState]:
    """One governor tick over every tier: judge and publish. Returns the judgements.

    A tier whose ledger cannot be read keeps its last published state until
    that expires; the others are still judged.
    """
    now = time.time() if now is None else now
    ttl = state_ttl_s(cfg)
    out: dict[str, BudgetState] = {}
    for tier, tc in cfg.tiers.items():
        try:
            await prune_marks(redis, cfg, tier, now)
            state = await assess(redis, cfg, tier, now)
            await publish_budget_state(redis, TierKeys(cfg.namespace, tier), state, ttl)
            set_budget_gauges(tier, state, [w.name for w in tc.budget.windows])
            out[tier] = state
        except Exception:
            log.exception("budget governor tick failed for %s", tier)
    return out


def set_budget_gauges(tier: str, state: BudgetState, configured_windows: list[str]) -> None:
    """Set fleet_spend_usd_total, fleet_budget_usd, fleet_projected_spend_usd and
    fleet_cost_per_million_tokens_usd of one tier from a judgement."""
    m.SPEND.labels(tier).set(state.day.usd)
    cost = state.cost_per_million_useful_usd
    m.COST_PER_MTOK.labels(tier).set(cost if math.isfinite(cost) else math.nan)
    active = {w.name for w in state.view.windows}
    for w in state.view.windows:
        m.BUDGET.labels(tier, w.name).set(w.budget_usd)
        m.PROJECTED_SPEND.labels(tier, w.name).set(w.projected_usd)
    for name in configured_windows:  # a named window that has closed has no projection
        if name not in active:
            with contextlib.suppress(KeyError):
                m.PROJECTED_SPEND.remove(tier, name)
