"""Per-key requests-per-minute and tokens-per-minute limits, atomic in Redis (the key's window).

A sliding window of sixty one-second buckets in one hash per key. One Lua
call counts the window, and either refuses or takes the request and its
*estimated* tokens in the same step, so a burst of concurrent requests cannot
slip past the limit (LiteLLM counts tokens after the call and bursts go
through). When the request ends, `settle` replaces the estimate with the real
count in the bucket it was taken from; `release` gives everything back (the
request was refused further on, expired or cancelled before it ran). Writer and
reader: the gateways' admission (`gateway.key_limits`).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.store.keys import ApiKeyKeys
from fleet.store.lua import CLOCK

WINDOW_S = 60

# KEYS: window ; ARGV: rpm (0: none) tpm (0: none) tokens
# Returns {1, bucket} when taken, {0, 'rpm'|'tpm', retry_after_s} when refused.
RESERVE = CLOCK + """
local now_s = now / 1000
local sec = math.floor(now_s)
local lo = sec - 59
local rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
local reqs, toks = 0, 0
local rb, tb = {}, {}
for i = 1, #all, 2 do
  local f = all[i]
  local b = tonumber(string.sub(f, 3))
  if b < lo then
    redis.call('HDEL', KEYS[1], f)
  else
    local v = tonumber(all[i + 1])
    if string.sub(f, 1, 1) == 'r' then
      reqs = reqs + v
      rb[b] = (rb[b] or 0) + v
    else
      toks = toks + v
      tb[b] = (tb[b] or 0) + v
    end
  end
end
-- Seconds until enough of the window's oldest buckets fall out for `need` more to fit.
local function wait_for(buckets, used, need, limit)
  local acc = 0
  for b = lo, sec do
    acc = acc + (buckets[b] or 0)
    if used - acc + need <= limit then return (b + 60) - now_s end
  end
  return 60
end
if rpm > 0 and reqs + 1 > rpm then
  return {0, 'rpm', tostring(wait_for(rb, reqs, 1, rpm))}
end
if tpm > 0 and toks + tokens > tpm then
  return {0, 'tpm', tostring(wait_for(tb, toks, tokens, tpm))}
end
redis.call('HINCRBY', KEYS[1], 'r:' .. sec, 1)
redis.call('HINCRBY', KEYS[1], 't:' .. sec, tokens)
redis.call('EXPIRE', KEYS[1], 120)
return {1, sec}
"""

# KEYS: window ; ARGV: bucket d_requests d_tokens
# Adjusts the bucket the reservation was taken from, if it is still in the window.
ADJUST = CLOCK + """
local b = tonumber(ARGV[1])
if b < math.floor(now / 1000) - 59 then return 0 end
if tonumber(ARGV[2]) ~= 0 then redis.call('HINCRBY', KEYS[1], 'r:' .. b, tonumber(ARGV[2])) end
if tonumber(ARGV[3]) ~= 0 then redis.call('HINCRBY', KEYS[1], 't:' .. b, tonumber(ARGV[3])) end
return 1
"""


@dataclass(frozen=True, slots=True)
class Taken:
    """One request's place in its key's window: settle or release it exactly once."""

    key: str  # the Redis hash
    bucket: int  # epoch second it was counted in
    tokens: int  # tokens reserved (the estimate)


@dataclass(frozen=True, slots=True)
class Limited:
    """The key is over its limit: which one, and when a request would fit."""

    limit: str  # "rpm" | "tpm"
    retry_after_s: float


class RateLimiter:
    def __init__(self, redis: Redis, namespace: str) -> None:
        self.namespace = namespace
        self._reserve = redis.register_script(RESERVE)
        self._adjust = redis.register_script(ADJUST)

    async def reserve(self, key_id: str, *, rpm: int | None, tpm: int | None, tokens: int) -> Taken | Limited:
        """Count the request and its estimated tokens, or refuse; one atomic round trip."""
        key = ApiKeyKeys(self.namespace, key_id).window
        tokens = max(0, int(tokens))
        out = await self._reserve(keys=[key], args=[rpm or 0, tpm or 0, tokens])
        if int(out[0]) == 1:
            return Taken(key, int(out[1]), tokens)
        which = out[1].decode() if isinstance(out[1], bytes) else str(out[1])
        return Limited(which, float(out[2]))

    async def settle(self, taken: Taken, real_tokens: int) -> None:
        """The request ended: its bucket now holds the real token count, not the estimate."""
        delta = int(real_tokens) - taken.tokens
        if delta:
            await self._adjust(keys=[taken.key], args=[taken.bucket, 0, delta])

    async def release(self, taken: Taken) -> None:
        """Give the request and its tokens back: it never ran."""
        await self._adjust(keys=[taken.key], args=[taken.bucket, -1, -taken.tokens])
