"""The per-key dollar budget as a step of the gateway's admission sequence.

Reserve the request's worst case (estimated prompt + max_tokens at the key's
price on its tier) before the tier decision; the ticket settles it to the
real usage at completion, or releases it on refusal, expiry, cancel or
failure. The atomic accounting is `fleet.keybudget`'s Lua.
"""

from __future__ import annotations

from redis.asyncio import Redis

from fleet.config import FleetConfig
from fleet.keybudget import SWEEP_MARGIN_MS, KeyBudget, worst_case_usd
from fleet.latency import per_replica_rate
from fleet.policy.budget import key_usd_per_million, tokens_usd
from gateway.admission import AdmissionRequest, Reservation, Usage, refusal


def tier_key_prices(cfg: FleetConfig) -> dict[str, float]:
    """Dollars per million tokens a key pays on each tier (see `key_usd_per_million`)."""
    out = {}
    for tier, tc in cfg.tiers.items():
        p = tc.sim
        tokens_per_s = per_replica_rate(p, tc.slots) * (p.typical_prompt_tokens + p.typical_output_tokens)
        out[tier] = key_usd_per_million(tc, tokens_per_s)
    return out


class _KeyBudgetReservation:
    __slots__ = ("budget", "key", "price", "rid")

    def __init__(self, budget: KeyBudget, key: str, rid: str, price: float) -> None:
        self.budget, self.key, self.rid, self.price = budget, key, rid, price

    async def settle(self, usage: Usage) -> None:
        await self.budget.settle(self.key, self.rid, tokens_usd(usage.total, self.price))

    async def release(self) -> None:
        await self.budget.release(self.key, self.rid)


class KeyBudgetStep:
    name = "key_budget"

    def __init__(self, cfg: FleetConfig, redis: Redis) -> None:
        self.budget = KeyBudget(redis, cfg.namespace)
        self.prices = tier_key_prices(cfg)

    async def reserve(self, req: AdmissionRequest) -> Reservation | None:
        key = req.caller.key
        if key is None or key.budget_usd is None:
            return None  # no budget on this key: no round trip
        price = self.prices[req.tier]
        want = worst_case_usd(req.prompt_tokens, req.max_tokens, price)
        got = await self.budget.reserve(key.name, req.rid, want, key.budget_usd,
                                        ttl_ms=req.deadline_ms + SWEEP_MARGIN_MS)
        if not got.ok:
            # Retry-After: reservations of requests in flight come back within their deadlines.
            held = got.reserved_usd > 0 and got.spent_usd + want <= key.budget_usd
            raise refusal("key_budget_exhausted",
                          f"API key {key.name!r} has ${got.left_usd:.4f} of its ${key.budget_usd:.2f} budget left "
                          f"(spent ${got.spent_usd:.4f}, ${got.reserved_usd:.4f} held by calls in flight); "
                          f"this call may cost up to ${want:.4f}",
                          req, req.deadline_ms / 1000 if held else 3600.0)
        return _KeyBudgetReservation(self.budget, key.name, req.rid, price)
