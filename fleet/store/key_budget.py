"""API keys' dollar budgets: `ApiKeyKeys.budget`. Reserve at admission, settle at completion,
release on refusal. Writer and reader: the gateways' admission (`gateway.key_limits`).

Counting tokens after the call lets a concurrent burst slip past a budget
(LiteLLM #18730): every caller checks before any has been charged. Here each
request first reserves its worst case (prompt estimate + max_tokens at the
key's price) in one Lua call that checks spent + reserved + this <= budget
and records the reservation, so 200 concurrent callers on a key with budget
for 50 get exactly 50 reservations. At completion the reservation is settled
to what the request actually cost, never more than it reserved (the excess,
if an estimate ran short, is kept as `unbilled` for the operator rather than
pushing the key past its budget); refusals, expiries and cancels release it.

Each reservation is its own field, `r:<request id>` -> "nano|expiry ms", so
settle and release are idempotent (the second finds nothing), and one that
was never settled (its gateway died) is swept once its expiry passes: the
request's deadline plus a margin, after which nothing can complete it.

Money is integer nano-dollars. Budgets are lifetime, like a virtual key's
max budget; an operator raises the key's `budget_usd` (or resets `spent`) to
extend it.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.store.keys import ApiKeyKeys
from fleet.store.lua import CLOCK, SHEBANG

NANO = 1_000_000_000
SWEEP_MARGIN_MS = 60_000  # past a request's deadline, its reservation is certainly stale

# KEYS: budget ; ARGV: rid nano budget_nano expiry_ms
RESERVE = CLOCK + """
local amount, budget = tonumber(ARGV[2]), tonumber(ARGV[3])
local f = redis.call('HMGET', KEYS[1], 'spent', 'reserved')
local spent, reserved = tonumber(f[1] or '0'), tonumber(f[2] or '0')
if spent + reserved + amount > budget then
  -- Before refusing, free reservations whose requests can no longer complete.
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local name = all[i]
    if string.sub(name, 1, 2) == 'r:' then
      local v = all[i + 1]
      local sep = string.find(v, '|', 1, true)
      if tonumber(string.sub(v, sep + 1)) <= now then
        redis.call('HDEL', KEYS[1], name)
        reserved = reserved - tonumber(string.sub(v, 1, sep - 1))
      end
    end
  end
  if reserved < 0 then reserved = 0 end
  redis.call('HSET', KEYS[1], 'reserved', n2s(reserved))
  if spent + reserved + amount > budget then
    return {0, n2s(spent), n2s(reserved)}
  end
end
if redis.call('HSETNX', KEYS[1], 'r:' .. ARGV[1], n2s(amount) .. '|' .. n2s(now + tonumber(ARGV[4]))) == 0 then
  return {1, n2s(spent), n2s(reserved)}  -- already holds a reservation: idempotent
end
redis.call('HINCRBY', KEYS[1], 'reserved', n2s(amount))
return {1, n2s(spent), n2s(reserved + amount)}
"""

# KEYS: budget ; ARGV: rid actual_nano
SETTLE = SHEBANG + """
local v = redis.call('HGET', KEYS[1], 'r:' .. ARGV[1])
if not v then return -1 end
local sep = string.find(v, '|', 1, true)
local held = tonumber(string.sub(v, 1, sep - 1))
local actual = tonumber(ARGV[2])
local charge = math.min(actual, held)
redis.call('HDEL', KEYS[1], 'r:' .. ARGV[1])
redis.call('HINCRBY', KEYS[1], 'reserved', string.format('%.0f', -held))
if charge > 0 then redis.call('HINCRBY', KEYS[1], 'spent', string.format('%.0f', charge)) end
if actual > held then redis.call('HINCRBY', KEYS[1], 'unbilled', string.format('%.0f', actual - held)) end
return charge
"""


@dataclass(frozen=True, slots=True)
class Reservation:
    ok: bool
    key: str
    rid: str
    nano: int
    spent_usd: float  # before this reservation
    reserved_usd: float
    budget_usd: float

    @property
    def left_usd(self) -> float:
        return max(0.0, self.budget_usd - self.spent_usd - self.reserved_usd)


def to_nano(usd: float) -> int:
    return round(usd * NANO)


class KeyBudget:
    """Reserve / settle / release against API keys' dollar budgets."""

    def __init__(self, redis: Redis, namespace: str) -> None:
        self.redis = redis
        self.namespace = namespace
        self._reserve = redis.register_script(RESERVE)
        self._settle = redis.register_script(SETTLE)

    def _key(self, name: str) -> str:
        return ApiKeyKeys(self.namespace, name).budget

    async def reserve(self, key: str, rid: str, usd: float, budget_usd: float, ttl_ms: int) -> Reservation:
        """Hold `usd` of `key`'s budget for request `rid`, or refuse (ok False)."""
        nano = max(0, to_nano(usd))
        ok, spent, reserved = await self._reserve(keys=[self._key(key)],
                                                  args=[rid, nano, to_nano(budget_usd), max(1, ttl_ms)])
        return Reservation(bool(int(ok)), key, rid, nano, int(spent) / NANO, int(reserved) / NANO, budget_usd)

    async def settle(self, key: str, rid: str, usd: float) -> float:
        """Charge what the request cost (at most what it reserved); returns dollars charged."""
        charged = int(await self._settle(keys=[self._key(key)], args=[rid, max(0, to_nano(usd))]))
        return max(0, charged) / NANO

    async def release(self, key: str, rid: str) -> None:
        """Give the reservation back uncharged (refused, expired, cancelled before work)."""
        await self._settle(keys=[self._key(key)], args=[rid, 0])

    async def state(self, key: str) -> dict[str, float]:
        """`spent`, `reserved`, `unbilled` in dollars, and `open` reservations."""
        got = await self.redis.hgetall(self._key(key))
        raw = {(k.decode() if isinstance(k, bytes) else k): v for k, v in got.items()}
        return {"spent": int(raw.get("spent", 0)) / NANO, "reserved": int(raw.get("reserved", 0)) / NANO,
                "unbilled": int(raw.get("unbilled", 0)) / NANO,
                "open": float(sum(1 for k in raw if k.startswith("r:")))}
