"""The budget governor's published judgement of a tier: `TierKeys.budget`.

Writer: the budget governor (`fleet.governor.govern`), run once per fleet by
the scaler holding the leader lease, or by the gateways while no scaler holds
it. Readers: the gateway's admission (the `exhausted` and `retry_at` fields,
read inside its one admission round trip, `fleet.store.admitting`), the
scaler (the ceiling), and the gateway's /v1/fleet/status and /metrics
(`read_budget_state`), which show what the governor judged instead of judging
again.

The hash expires after a few governor ticks, so a governor that stopped
leaves no stale refusal behind: no hash means "not judged", and admission then
admits (the scaler, for a tier with a budget, then holds what it has).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from fleet.policy.tier_budget import BudgetView, WindowView
from fleet.store.keys import TierKeys
from fleet.store.ledger import STATES, Spend

# The fields admission reads in its Lua (by these names): the judgement itself.
EXHAUSTED, RETRY_AT = "exhausted", "retry_at"


@dataclass(frozen=True, slots=True)
class BudgetState:
    """One tier's judgement, and the spend behind it."""

    view: BudgetView
    day: Spend  # the budget day so far (from the last reset)
    day_start: float
    day_end: float
    lifetime_usd: float
    cost_per_million_useful_usd: float  # over the budget day so far; inf with no useful token
    judged_at: float  # epoch seconds


def _f(x: float | None, digits: int = 9) -> str:
    return "" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _fields(s: BudgetState) -> dict[str, str]:
    """The record as hash fields: the judgement flat (admission and the scaler read single
    fields), the windows and the day's spend as JSON (the status page reads them whole)."""
    v, d = s.view, s.day
    return {
        EXHAUSTED: "1" if v.exhausted else "0",
        RETRY_AT: f"{v.retry_at:.3f}" if v.exhausted and v.retry_at else "0",
        "window": v.window or "",
        "spent": _f(v.spent_usd),
        "projected": _f(v.projected_usd),
        "budget": _f(v.budget_usd),
        "ceiling": "" if v.ceiling is None else str(v.ceiling),
        "capped": "1" if v.capped else "0",
        "burn_usd_per_h": f"{v.burn_usd_per_s * 3600:.6f}",
        "reason": v.reason,
        "windows": orjson.dumps([{"name": w.name, "start": w.start, "end": w.end, "budget_usd": w.budget_usd,
                                  "spent_usd": w.spent_usd, "projected_usd": w.projected_usd,
                                  "ceiling": w.ceiling, "exhausted": w.exhausted} for w in v.windows]).decode(),
        "day": orjson.dumps({"start": s.day_start, "end": s.day_end, "usd": d.usd, "token_usd": d.token_usd,
                             "replica_s": d.replica_s, "tokens": d.tokens, "completion_tokens": d.completion_tokens,
                             "useful_tokens": d.useful_tokens}).decode(),
        "lifetime_usd": _f(s.lifetime_usd),
        "cost_per_million_useful_usd": _f(s.cost_per_million_useful_usd),
        "ts": f"{s.judged_at:.3f}",
    }


async def publish_budget_state(redis: Redis, keys: TierKeys, state: BudgetState, ttl_s: int) -> None:
    """Write the judgement; it lives `ttl_s` unless the next tick replaces it."""
    async with redis.pipeline(transaction=True) as p:
        p.hset(keys.budget, mapping=_fields(state))
        p.expire(keys.budget, ttl_s)
        await p.execute()


def _num(v: str, default: float | None = None) -> float | None:
    return float(v) if v not in ("", None) else default


def parse_budget_state(raw: dict[Any, Any]) -> BudgetState:
    """The record from its hash fields (bytes or str)."""
    d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
         for k, v in raw.items()}
    exhausted = d.get(EXHAUSTED) == "1"
    retry_at = _num(d.get(RETRY_AT, ""))
    windows = tuple(WindowView(w["name"], w["start"], w["end"], w["budget_usd"], w["spent_usd"], w["projected_usd"],
                               w["ceiling"], w["exhausted"]) for w in orjson.loads(d.get("windows") or "[]"))
    view = BudgetView(
        exhausted=exhausted, window=d.get("window") or None, retry_at=retry_at if exhausted and retry_at else None,
        spent_usd=_num(d.get("spent", ""), 0.0) or 0.0, projected_usd=_num(d.get("projected", ""), 0.0) or 0.0,
        budget_usd=_num(d.get("budget", "")), ceiling=int(d["ceiling"]) if d.get("ceiling") else None,
        capped=d.get("capped") == "1", burn_usd_per_s=(_num(d.get("burn_usd_per_h", ""), 0.0) or 0.0) / 3600,
        reason=d.get("reason", ""), windows=windows)
    day = orjson.loads(d.get("day") or "{}")
    spend = Spend(usd=day.get("usd", 0.0), token_usd=day.get("token_usd", 0.0),
                  replica_s={s: float(day.get("replica_s", {}).get(s, 0.0)) for s in STATES},
                  tokens=int(day.get("tokens", 0)), completion_tokens=int(day.get("completion_tokens", 0)),
                  useful_tokens=int(day.get("useful_tokens", 0)))
    cost = _num(d.get("cost_per_million_useful_usd", ""))
    return BudgetState(view=view, day=spend, day_start=float(day.get("start", 0.0)), day_end=float(day.get("end", 0.0)),
                       lifetime_usd=_num(d.get("lifetime_usd", ""), 0.0) or 0.0,
                       cost_per_million_useful_usd=math.inf if cost is None else cost,
                       judged_at=_num(d.get("ts", ""), 0.0) or 0.0)


async def read_budget_state(redis: Redis, keys: TierKeys) -> BudgetState | None:
    """The current judgement, or None when none is (no governor ticked within the TTL)."""
    raw = await redis.hgetall(keys.budget)
    if not raw:
        return None
    try:
        return parse_budget_state(raw)
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
        return None
