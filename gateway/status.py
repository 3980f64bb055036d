"""The fleet status document served at /v1/fleet/status and shown by `fleet status`."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from fleet.config import CLASSES, FleetConfig
from fleet.governor import budget_status
from fleet.latency import cold_start_s, per_replica_rate
from fleet.line import Line
from fleet.policy import rate, seconds_to_drain
from fleet.replicas import by_state, read_replicas
from fleet.scalestate import read_scaler_state


async def tier_status(cfg: FleetConfig, redis: Redis, line: Line) -> dict[str, Any]:
    tc = cfg.tiers[line.tier]
    snap = await line.observe()
    replicas = await read_replicas(redis, line.keys, cfg.heartbeat_s)
    served = rate(snap.completions_in_window, cfg.rate_window_s)
    states = by_state(replicas)
    sc = await read_scaler_state(redis, line.keys)  # None: no scaler running
    return {
        "line": dict(zip(CLASSES, snap.by_class, strict=True)),
        "waiting": snap.waiting,
        "in_flight": snap.inflight,
        "oldest_wait_s": snap.oldest_wait_s,
        "arrival_rate": rate(snap.arrivals_in_window, cfg.rate_window_s),
        "service_rate": served,
        "seconds_to_drain": seconds_to_drain(snap.waiting, served),
        "drain_threshold_s": tc.drain_threshold_s,
        "replicas": states,
        "replica_detail": [{"id": r.id, "state": r.state, "in_use": r.in_use, "slots": r.slots,
                            "completed": r.completed, "cold_start_s": r.cold_start_s} for r in replicas],
        "floor": sc["floor"] if sc else tc.warm_floor,
        "ceiling": sc["ceiling"] if sc else tc.max_replicas,
        "ceiling_by": sc["ceiling_by"] if sc else "max_replicas",
        "prewarm": ({"floor": sc["prewarm_floor"], "until": sc["prewarm_until"], "source": sc["prewarm_source"]}
                    if sc and sc["prewarm_floor"] else None),
        "last_decision": ({"action": sc["action"], "delta": sc["delta"], "reason": sc["reason"], "at": sc["at"],
                           "last_change": sc.get("last_reason")} if sc else None),
        **(await budget_status(redis, cfg, line.tier)),  # spend, projected, budget, ceiling, $/M useful tokens
        "expected_cold_start_s": cold_start_s(tc.sim),
        "per_replica_rate": per_replica_rate(tc.sim, tc.slots),
        "outcomes": {k: snap.counters.get(k, 0) for k in ("accepted", "completed", "expired", "cancelled",
                                                            "failed", "requeued")},
        "tokens": {"prompt": snap.counters.get("prompt_tokens", 0),
                   "completion": snap.counters.get("completion_tokens", 0)},
    }


async def fleet_status(cfg: FleetConfig, redis: Redis, lines: dict[str, Line]) -> dict[str, Any]:
    import math

    tiers = {t: await tier_status(cfg, redis, line) for t, line in lines.items()}
    for s in tiers.values():  # JSON has no infinity
        if math.isinf(s["seconds_to_drain"]):
            s["seconds_to_drain"] = None
    return {"tiers": tiers}
