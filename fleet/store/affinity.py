"""Prefix-affine claims: a replica's claim prefers the call whose prefix it served last, so a
chain's turns land where their KV cache is (docs/prefix-affinity.md).

The records (one tier, all under its hash tag; `fleet.store.keys.TierKeys.affinity`):

- `aff` HASH prefix key -> the replica that last claimed a call of that prefix, `aff:at` ZSET
  prefix key -> when (ms), `aff:n` HASH replica -> how many prefixes it holds. Bounded: a
  prefix older than `hold_ms` is forgotten, and at most `max_keys` are kept (oldest first).
- `claimers` ZSET replica -> when it last ran a claim (ms): a replica that claimed within
  `live_ms` is live, so a call may wait for it; one gone (drained, dead) holds nothing.

Writer: the affine claim (`AFFINE_CLAIM`, run by every replica of the tier through
`AffineLine`). Readers: the same claim, and the scaler (`cached_prefixes`: which replica's
cache is coldest, for the scale-in victim). The prefix key itself is the gateway's
(`fleet.prefix.affinity_key`), stored in the request hash as `aff` at enqueue.

The line's plain claim (`fleet.store.line_scripts.CLAIM`) is left as it is: this one differs
only in which of the first `window` calls of the best class it takes (see AFFINE_CLAIM); both
take a call with the one Lua function `take` (`fleet.store.line_lua.TAKE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from fleet.classes import Affinity
from fleet.config import FleetConfig
from fleet.store.keys import TierKeys
from fleet.store.line import Line
from fleet.store.line_lua import LINE_CONSTS, RETIRE, TAKE
from fleet.store.lua import Script, named

# A replica waits on the bell at most a second between claims (`workers.waiting.WAIT_S`); one that
# ran no claim for three is full or gone, and a call does not wait for it.
LIVE_MS = 3000


@dataclass(frozen=True, slots=True)
class AffinityRules:
    """What the affine claim is told (from a tier's `affinity:`, `fleet.classes.Affinity`)."""

    window: int = 8
    wait_ms: tuple[int, ...] = (50, 40, 40, 40)  # per class rank, highest first
    slack_ms: int = 1000
    hold_ms: int = 600_000
    max_keys: int = 10_000
    live_ms: int = LIVE_MS

    @classmethod
    def of(cls, a: Affinity, wait_limit_s: dict[str, float]) -> AffinityRules | None:
        """The rules of a tier, or None where affinity is off (the plain claim runs)."""
        if not a.enabled:
            return None
        return cls(a.window, a.waits_ms(wait_limit_s), a.slack_ms, int(a.hold_s * 1000), a.max_keys)

    def named(self) -> dict[str, Any]:
        """The claim's arguments these rules fill (`RULES`)."""
        return {"window": self.window, "wait_ms": ",".join(str(w) for w in self.wait_ms), "slack_ms": self.slack_ms,
                "hold_ms": self.hold_ms, "live_ms": self.live_ms, "max_keys": self.max_keys}


# AFFINE_CLAIM's arguments that come from a tier's `AffinityRules` (`wait_ms`: per class rank, comma-separated).
RULES = ("window", "wait_ms", "slack_ms", "hold_ms", "live_ms", "max_keys")


# Returns {more, claimed, retry_ms}: `more` and `claimed` as CLAIM's; `retry_ms` > 0 when the claim
# left calls waiting for the replica that holds their prefix: they are anyone's in that many ms.
#
# Each slot looks at the first `window` calls of the best class waiting, in the line's order, and takes:
#   1. a call of a prefix this replica holds (its cache has it), unless a call ahead of it is due;
#   2. else the first call that no other live replica holds, or that is due;
#   3. else nothing: every call looked at waits for its replica (rung on its wake key), and the
#      claim stops, so no lower class goes ahead of them.
# A call is due once it waited its class's hold, has less than `slack_ms` left, or a replica
# preempted for it (`pmark`): a due call is never passed over nor held back. A call that ended in
# the line, or whose hash is gone, is dropped on the way as CLAIM drops it (the same `take`).
AFFINE_CLAIM = Script(
    "AFFINE_CLAIM",
    keys=("line", "inflight", "counters", "affinity", "affinity_at", "affinity_count", "claimers"),
    args=("n", "replica", "lease_ms", "prefix", "ttl_s", "caps", *RULES),
    consts=LINE_CONSTS, uses=(RETIRE, TAKE), body="""
local out, pops, more, retry = {}, 0, 1, 0
local want, lease, ttl, cap = tonumber(n), tonumber(lease_ms), tonumber(ttl_s), parse_caps(caps)
local me, seen_window, waits = replica, tonumber(window), {}
for w in string.gmatch(wait_ms, '[^,]+') do waits[#waits + 1] = tonumber(w) end
local slack, hold, live, maxkeys = tonumber(slack_ms), tonumber(hold_ms), tonumber(live_ms), tonumber(max_keys)
redis.call('ZADD', claimers, n2s(now), me)
local rung = {}
local function holder_of(key)
  if not key or key == '' then return nil end
  local h = redis.call('HGET', affinity, key)
  if not h then return nil end
  if h == me then return h end
  local seen = redis.call('ZSCORE', claimers, h)
  if seen and tonumber(seen) >= now - live then return h end
  return nil
end
-- One slot: the rid to take (or drop), or nil when every call looked at waits for its replica.
local function choose(rank)
  local wait = waits[rank + 1]
  local cands = redis.call('ZRANGEBYSCORE', line, n2s(rank * CLASS_SPAN), '(' .. n2s((rank + 1) * CLASS_SPAN),
    'LIMIT', 0, seen_window)
  local first = nil
  for _, rid in ipairs(cands) do
    local f = redis.call('HMGET', request_key(rid), 'state', 'deadline', 'enq', 'aff', 'pmark')
    if f[1] ~= 'queued' or tonumber(f[2]) <= now then return first or rid end
    local waited, left = now - tonumber(f[3]), tonumber(f[2]) - now
    local h = holder_of(f[4])
    if h == me then return rid end
    if waited >= wait or left <= slack or (f[5] and f[5] ~= '') then return first or rid end
    if h then
      local due = wait - waited
      if retry == 0 or due < retry then retry = due end
      if not rung[h] then
        rung[h] = true
        local wake = wake_key(h)
        redis.call('LPUSH', wake, 1)
        redis.call('LTRIM', wake, 0, 0)
        redis.call('PEXPIRE', wake, 10000)
      end
    elseif not first then
      first = rid
    end
  end
  return first
end
local function forget(key)
  local h = redis.call('HGET', affinity, key)
  if h then redis.call('HINCRBY', affinity_count, h, -1) end
  redis.call('HDEL', affinity, key)
  redis.call('ZREM', affinity_at, key)
end
local function remember(key)
  local h = redis.call('HGET', affinity, key)
  if h ~= me then
    if h then redis.call('HINCRBY', affinity_count, h, -1) end
    redis.call('HINCRBY', affinity_count, me, 1)
    redis.call('HSET', affinity, key, me)
  end
  redis.call('ZADD', affinity_at, n2s(now), key)
end
while #out < want and pops < 4 * want + 16 do
  pops = pops + 1
  local head = redis.call('ZRANGE', line, 0, 0, 'WITHSCORES')
  if #head == 0 then
    more = 0
    break
  end
  local rank = math.floor(tonumber(head[2]) / CLASS_SPAN)
  if cap and #out >= cap[rank + 1] then  -- its class has no slot here
    more = 0
    break
  end
  local rid = choose(rank)
  if not rid then
    more = 0
    break
  end
  redis.call('ZREM', line, rid)
  local row, aff = take(rid, me, lease, ttl, inflight, counters)
  if row then
    if aff and aff ~= '' then remember(aff) end
    out[#out + 1] = row
  end
end
-- Bounded upkeep: forget prefixes older than `hold`, and the oldest beyond `maxkeys`, a few a claim.
for _, key in ipairs(redis.call('ZRANGEBYSCORE', affinity_at, '-inf', n2s(now - hold), 'LIMIT', 0, 8)) do
  forget(key)
end
local over = redis.call('ZCARD', affinity_at) - maxkeys
if over > 0 then
  for _, key in ipairs(redis.call('ZRANGE', affinity_at, 0, math.min(over, 8) - 1)) do forget(key) end
end
redis.call('ZREMRANGEBYSCORE', claimers, '-inf', n2s(now - 100 * live))
return {more, out, n2s(retry)}
""")


class AffineLine(Line):
    """A tier's line whose claims prefer what this replica has cached (`AFFINE_CLAIM`); the rest
    of the line protocol is `Line`'s."""

    def __init__(self, redis: Redis, namespace: str, tier: str, *, rules: AffinityRules, **kw: Any) -> None:
        super().__init__(redis, namespace, tier, **kw)
        self.rules = rules
        self._claim = named(redis.register_script(AFFINE_CLAIM))

    def _claim_named(self, replica: str, n: int, lease_s: float, caps: tuple[int, ...] | None) -> dict[str, Any]:
        k = self.keys
        return {**super()._claim_named(replica, n, lease_s, caps), "affinity": k.affinity,
                "affinity_at": k.affinity_at, "affinity_count": k.affinity_count, "claimers": k.claimers,
                **self.rules.named()}


def tier_line(redis: Redis, cfg: FleetConfig, tier: str, blocking: Redis | None = None) -> Line:
    """A replica's line of `tier`: affine where the tier's `affinity:` is on, else the plain one."""
    tc = cfg.tiers[tier]
    kw: dict[str, Any] = {"result_ttl_s": cfg.result_ttl_s, "rate_window_s": cfg.rate_window_s, "blocking": blocking}
    rules = AffinityRules.of(tc.affinity, tc.wait_limit_s)
    if rules is None:
        return Line(redis, cfg.namespace, tier, **kw)
    return AffineLine(redis, cfg.namespace, tier, rules=rules, **kw)


async def cached_prefixes(redis: Redis, keys: TierKeys) -> dict[str, int]:
    """Replica -> prefixes it holds now (served within `hold_s`): the reader the scaler uses to pick
    the scale-in victim with the coldest cache. Empty where affinity never ran."""
    raw = await redis.hgetall(keys.affinity_count)
    return {(k.decode() if isinstance(k, bytes) else str(k)): max(0, int(v)) for k, v in raw.items()}


__all__ = ["AFFINE_CLAIM", "LIVE_MS", "AffineLine", "AffinityRules", "cached_prefixes", "tier_line"]
