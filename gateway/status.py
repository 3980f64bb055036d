"""The fleet status document served at /v1/fleet/status and shown by `fleet status`.

Everything here is read, nothing judged: the line and the replicas as Redis
holds them now, the scaler's last decision (`fleet.store.scaler_state`), and
the budget governor's last judgement (`fleet.store.tier_budget`), with the
time it was made.
"""

from __future__ import annotations

import math
from typing import Any

from redis.asyncio import Redis

from fleet.config import CLASSES, FleetConfig
from fleet.latency import cold_start_s, per_replica_rate
from fleet.policy import rate, seconds_to_drain
from fleet.store.heartbeats import count_by_state, read_heartbeats
from fleet.store.line import Line
from fleet.store.scaler_state import read_scaler_state
from fleet.store.tier_budget import BudgetState, read_budget_state


def _finite(x: float | None, digits: int = 6) -> float | None:
    """JSON has no infinity: an unbounded figure is reported as null."""
    return None if x is None or not math.isfinite(x) else round(x, digits)


def budget_status(state: BudgetState | None) -> dict[str, Any]:
    """A tier's spend and budget as the governor last judged them: today's spend (the budget
    day), projected spend, budget and the ceiling it allows, replica-hours by state, tokens,
    the cost per million useful tokens. All null before the first judgement."""
    if state is None:
        return {"spend_usd": None, "projected_spend_usd": None, "budget_usd": None, "budget_ceiling": None,
                "replica_hours": {"total": None}, "cost_per_million_useful_tokens_usd": None,
                "budget": None, "tokens_today": None, "spend_lifetime_usd": None}
    v, day = state.view, state.day
    return {
        "spend_usd": round(day.usd, 6),
        "projected_spend_usd": round(v.projected_usd, 6) if v.budget_usd is not None else None,
        "budget_usd": v.budget_usd,
        "budget_ceiling": v.ceiling,
        "replica_hours": {**{s: round(h / 3600, 6) for s, h in day.replica_s.items()},
                          "total": round(day.replica_hours, 6)},
        "cost_per_million_useful_tokens_usd": _finite(state.cost_per_million_useful_usd),
        "budget": {
            "exhausted": v.exhausted, "window": v.window, "retry_at": v.retry_at, "capped": v.capped,
            "burn_usd_per_hour": round(v.burn_usd_per_s * 3600, 6), "reason": v.reason,
            "judged_at": state.judged_at,
            "day": {"start": state.day_start, "end": state.day_end},
            "windows": [{"name": w.name, "start": w.start, "end": w.end, "budget_usd": w.budget_usd,
                         "spent_usd": round(w.spent_usd, 6), "projected_usd": round(w.projected_usd, 6),
                         "ceiling": w.ceiling, "exhausted": w.exhausted} for w in v.windows],
        },
        "tokens_today": {"total": day.tokens, "completion": day.completion_tokens, "useful": day.useful_tokens,
                         "token_usd": round(day.token_usd, 6)},
        "spend_lifetime_usd": round(state.lifetime_usd, 6),
    }


async def tier_status(cfg: FleetConfig, redis: Redis, line: Line) -> dict[str, Any]:
    tc = cfg.tiers[line.tier]
    snap = await line.observe()
    replicas = await read_heartbeats(redis, line.keys, cfg.heartbeat_s)
    served = rate(snap.completions_in_window, cfg.rate_window_s)
    sc = await read_scaler_state(redis, line.keys)  # None: no scaler running
    return {
        "line": dict(zip(CLASSES, snap.by_class, strict=True)),
        "waiting": snap.waiting,
        "in_flight": snap.inflight,
        "oldest_wait_s": snap.oldest_wait_s,
        "arrival_rate": rate(snap.arrivals_in_window, cfg.rate_window_s),
        "service_rate": served,
        "seconds_to_drain": _finite(seconds_to_drain(snap.waiting, served), 9),
        "drain_threshold_s": tc.drain_threshold_s,
        "replicas": count_by_state(replicas),
        "replica_detail": [{"id": r.id, "state": r.state, "in_use": r.in_use, "slots": r.slots,
                            "completed": r.completed, "cold_start_s": r.cold_start_s} for r in replicas],
        "floor": sc.floor if sc else tc.warm_floor,
        "ceiling": sc.ceiling if sc else tc.max_replicas,
        "ceiling_by": sc.ceiling_by if sc else "max_replicas",
        "prewarm": ({"floor": sc.prewarm_floor, "until": sc.prewarm_until, "source": sc.prewarm_source}
                    if sc and sc.prewarm_floor else None),
        "last_decision": ({"action": sc.action, "delta": sc.delta, "reason": sc.reason, "at": sc.at,
                           "last_change": sc.last_reason or None} if sc else None),
        **budget_status(await read_budget_state(redis, line.keys)),
        "expected_cold_start_s": cold_start_s(tc.sim),
        "per_replica_rate": per_replica_rate(tc.sim, tc.slots),
        "outcomes": {k: snap.counters.get(k, 0) for k in ("accepted", "completed", "expired", "cancelled",
                                                            "failed", "requeued")},
        "tokens": {"prompt": snap.counters.get("prompt_tokens", 0),
                   "completion": snap.counters.get("completion_tokens", 0)},
    }


async def fleet_status(cfg: FleetConfig, redis: Redis, lines: dict[str, Line]) -> dict[str, Any]:
    return {"tiers": {t: await tier_status(cfg, redis, line) for t, line in lines.items()}}
