"""The API key's own limits, as steps of the gateway's admission sequence.

Both are kept under the key's digest (`ApiKeyKeys`), never its name.

- requests and tokens per minute (`rpm`, `tpm`): one atomic round trip that
  counts the window and takes the request and its estimated tokens, or refuses
  (`fleet.store.key_limits`);
- the key's dollar budget (`budget_usd`): reserve the request's worst case
  (estimated prompt + max_tokens at the key's price on its tier) before the
  tier decision; the ticket settles it to the real usage at completion, or
  releases it on refusal, expiry, cancel or failure (`fleet.store.key_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.config import FleetConfig
from fleet.policy.key_budget import key_usd_per_million, tokens_usd, worst_case_usd
from fleet.policy.tier_capacity import tier_capacity
from fleet.store.key_budget import SWEEP_MARGIN_MS, KeyBudget
from fleet.store.key_limits import Limited, RateLimiter, Taken
from gateway.tickets import AdmissionRequest, Reservation, Usage, refusal


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

    def __init__(self, cfg: FleetConfig, redis: Redis) -> None:
        self.limiter = RateLimiter(redis, cfg.namespace)

    async def reserve(self, req: AdmissionRequest) -> Reservation | None:
        key = req.caller.key
        if key is None or (key.rpm is None and key.tpm is None):
            return None  # nothing to count: no round trip
        got = await self.limiter.reserve(key.sha256, rpm=key.rpm, tpm=key.tpm, tokens=req.estimated_tokens)
        if isinstance(got, Limited):
            what = (f"{key.rpm} requests per minute" if got.limit == "rpm"
                    else f"{key.tpm} tokens per minute (this request may use {req.estimated_tokens})")
            raise refusal("rate_limited", f"API key {key.name!r} is over its limit of {what}", req,
                          got.retry_after_s)
        return _RateReservation(self.limiter, got)


def tier_key_prices(cfg: FleetConfig) -> dict[str, float]:
    """Dollars per million tokens a key pays on each tier (see `key_usd_per_million`)."""
    return {tier: key_usd_per_million(tc, tier_capacity(tc).tokens_per_s) for tier, tc in cfg.tiers.items()}


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
        got = await self.budget.reserve(key.sha256, req.rid, want, key.budget_usd,
                                        ttl_ms=req.deadline_ms + SWEEP_MARGIN_MS)
        if not got.ok:
            # Retry-After: reservations of requests in flight come back within their deadlines.
            held = got.reserved_usd > 0 and got.spent_usd + want <= key.budget_usd
            raise refusal("key_budget_exhausted",
                          f"API key {key.name!r} has ${got.left_usd:.4f} of its ${key.budget_usd:.2f} budget left "
                          f"(spent ${got.spent_usd:.4f}, ${got.reserved_usd:.4f} held by calls in flight); "
                          f"this call may cost up to ${want:.4f}",
                          req, req.deadline_ms / 1000 if held else 3600.0)
        return _KeyBudgetReservation(self.budget, key.sha256, req.rid, price)
