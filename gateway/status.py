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

from fleet.config import CLASSES, FleetConfig, TierConfig
from fleet.observe import read_tier
from fleet.policy import (
    arrival_rate,
    calibrated_capacity,
    drain_s,
    modelled_startup_s,
    replicas_by_version,
    service_rate,
    waiting,
)
from fleet.policy.cold_start import ColdStartPhases, median_phases, model_error, modelled_startup
from fleet.policy.prewarm import ColdStart, planning_cold_start, prewarm_lead_s, window_plans
from fleet.store.capacity import read_calibration
from fleet.store.chains import ChainOutcomes, read_chains
from fleet.store.line import Line
from fleet.store.model_registry import ModelRecord, read_record
from fleet.store.scaler_state import ScalerState, read_scaler_state
from fleet.store.tier_budget import BudgetState
from gateway.admission import TierView


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


SCALER_TICK_S = 1.0  # `fleet scaler --tick`'s default: the margin, until a scaler has published its own


def prewarm_windows(tc: TierConfig, now: float, startup_s: float, cold_starts: list[float],
                    sc: ScalerState | None = None) -> list[dict[str, Any]]:
    """Each scheduled pre-warm window's instance in force or next, planned by the scaler's own
    rule (`fleet.policy.prewarm`): when its replicas start, when they must be ready, and why.

    With a scaler running (`sc`), the plan is the scaler's: the cold start it plans `ready_at`
    windows with (its launch-to-ready p95, which counts the process start the replicas' own
    figures leave out), its expected start-up and its tick, as it published them. Without one,
    the same rule on what the page can see: the replicas' own cold starts, else the model's.
    """
    if sc is not None and sc.ready_cold_s is not None:
        cold = ColdStart(sc.ready_cold_s, sc.ready_cold_measured, sc.ready_cold_source)
        tick_s, startup_s = sc.tick_s or SCALER_TICK_S, sc.startup_s if sc.startup_s is not None else startup_s
    else:
        cold, tick_s = planning_cold_start((), cold_starts, modelled_startup_s(tc)), SCALER_TICK_S
    plans = window_plans(tc.prewarm, now, lead_s=prewarm_lead_s(startup_s, tick_s), startup_s=startup_s,
                         cold=cold, tick_s=tick_s, tz=tc.budget.timezone)
    return [{"kind": p.kind, "cron": p.cron, "floor": p.floor, "start": p.start, "ready_by": p.at, "end": p.end,
             "active": p.active, "why": p.why, "timezone": tc.budget.timezone} for p in plans]


def cold_start_status(tc: TierConfig, phases: list[ColdStartPhases]) -> dict[str, Any]:
    """The live replicas' cold starts by phase beside the model the fleet budgets with
    (`fleet.policy.cold_start`): the median of each phase, the modelled terms, and each term's
    error (measured - modelled; positive: slower than the profile says)."""
    mod = modelled_startup(tc)
    return {
        "replicas": len(phases),
        "measured": median_phases(phases),
        "modelled": {"load_s": mod.load_s, "warmup_s": mod.warmup_s, "total_s": mod.total_s},
        "error": [{"term": e.term, "measured_s": round(e.measured_s, 6), "modelled_s": e.modelled_s,
                   "error_s": _finite(e.error_s), "ratio": _finite(e.ratio, 4)} for e in model_error(phases, mod)],
    }


def model_status(rec: ModelRecord | None, seed: str) -> dict[str, Any]:
    """What the model registry says of the tier: the live version, the previous known-good, the
    rollout (state: rolling, canary, done) and when it started."""
    if rec is None:
        return {"live": seed, "previous": None, "rollout": None, "seeded": False}
    ro = rec.rollout
    state = None if ro is None else ("done" if ro.done_at else "canary" if ro.canary and not ro.judged else "rolling")
    return {"live": rec.live, "previous": rec.previous, "seeded": True,
            "rollout": None if ro is None else {"kind": ro.kind, "from": ro.from_version, "to": ro.to_version,
                                                "state": state, "by": ro.by, "started": ro.started,
                                                "judged": ro.judged, "canary": ro.canary, "done_at": ro.done_at}}


async def tier_status(cfg: FleetConfig, redis: Redis, line: Line, view: TierView | None = None) -> dict[str, Any]:
    """One tier's status. `view`: what this gateway's admission holds of the tier (its replicas
    and its calibrated capacity, refreshed each heartbeat)."""
    tc = cfg.tiers[line.tier]
    live = await read_tier(redis, line, heartbeat_s=cfg.heartbeat_s, window_s=cfg.rate_window_s)
    obs, snap = live.obs, live.snap
    sc = await read_scaler_state(redis, line.keys)  # None: no scaler running
    # What admission and scaling assume: the admission's view, else the scaler's published calibration.
    cap = view.capacity if view is not None else calibrated_capacity(tc, await read_calibration(redis, line.keys))
    rec = await read_record(redis, line.keys)  # None until a scaler, worker or admin call seeds the registry
    return {
        "model": model_status(rec, tc.version),
        "versions": replicas_by_version(obs.replicas.members, rec.live if rec else tc.version),
        "line": dict(zip(CLASSES, obs.line, strict=True)),
        "waiting": waiting(obs),
        "in_flight": obs.in_flight,
        "oldest_wait_s": obs.oldest_wait_s,
        "arrival_rate": arrival_rate(obs),
        "service_rate": service_rate(obs),
        "seconds_to_drain": _finite(drain_s(obs), 9),
        "drain_threshold_s": tc.drain_threshold_s,
        "replicas": obs.replicas.by_state,
        "replica_detail": [{"id": r.id, "state": r.state, "version": r.version, "in_use": r.in_use, "slots": r.slots,
                            "completed": r.completed, "cold_start_s": r.cold_start_s,
                            "cold_start_phases": r.cold_start_phases.as_dict() if r.cold_start_phases else None}
                           for r in live.beats],
        "floor": sc.floor if sc else tc.warm_floor,
        "ceiling": sc.ceiling if sc else tc.max_replicas,
        "ceiling_by": sc.ceiling_by if sc else "max_replicas",
        "prewarm": ({"floor": sc.prewarm_floor, "until": sc.prewarm_until, "source": sc.prewarm_source}
                    if sc and sc.prewarm_floor else None),
        "prewarm_windows": prewarm_windows(tc, obs.now, cap.startup_s,
                                           [r.cold_start_s for r in live.beats if r.cold_start_s is not None], sc),
        "last_decision": ({"action": sc.action, "delta": sc.delta, "reason": sc.reason, "at": sc.at,
                           "last_change": sc.last_reason or None} if sc else None),
        **budget_status(live.budget),
        "expected_cold_start_s": cap.startup_s,
        "cold_start": cold_start_status(tc, [r.cold_start_phases for r in live.beats if r.cold_start_phases]),
        "per_replica_rate": cap.per_replica_rate,
        "rate_factor": cap.rate_factor,
        "admission": ({"ready": view.replicas.ready, "starting": view.replicas.starting} if view is not None
                      else None),
        "outcomes": {k: snap.counters.get(k, 0) for k in ("accepted", "completed", "expired", "cancelled",
                                                            "failed", "requeued")},
        "preemptions": {"total": snap.counters.get("preempted", 0),
                        **{c: snap.counters.get(f"preempted:{c}", 0) for c in CLASSES}},
        "tokens": {"prompt": snap.counters.get("prompt_tokens", 0),
                   "completion": snap.counters.get("completion_tokens", 0)},
        # Calls this tier refused and a smaller one served (out), and those it served for a larger
        # one (in): docs/degrade.md. Where it goes: its rule's target.
        "degraded": {"out": snap.counters.get("degraded_out", 0), "in": snap.counters.get("degraded_in", 0),
                     "to": tc.degrade.to if tc.degrade else None},
    }


async def fleet_status(cfg: FleetConfig, redis: Redis, lines: dict[str, Line],
                       views: dict[str, TierView] | None = None) -> dict[str, Any]:
    return {"tiers": {t: await tier_status(cfg, redis, line, (views or {}).get(t)) for t, line in lines.items()},
            "chains": chain_status(await read_chains(redis, cfg.namespace))}


def chain_status(c: ChainOutcomes) -> dict[str, Any]:
    """Chains as a whole (X-Chain-Id): open now, completed, with a call refused or late, and the
    completion time of the last 1,000 completed, in all and by the tier and class of their first call."""
    keys = sorted(set(c.completed) | set(c.refused_or_late))
    return {"open": c.open, "completed": sum(c.completed.values()),
            "refused_or_late": sum(c.refused_or_late.values()),
            "completion_p50_s": c.p50_s, "completion_p99_s": c.p99_s,
            "by_tier_class": [{"tier": t, "class": k, "completed": c.completed.get((t, k), 0),
                               "refused_or_late": c.refused_or_late.get((t, k), 0)} for t, k in keys]}
