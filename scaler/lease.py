"""Leader lease: only one scaler acts at a time; a standby takes over when it stops renewing.

SET NX PX takes the lease; the holder renews it every tick with a
compare-and-expire script, so a scaler that lost it (paused, partitioned)
can never extend someone else's lease, and finds out at its next tick.
"""

from __future__ import annotations

from redis.asyncio import Redis

# Renew if we hold it, else take it if it is free: one round trip, atomic.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    def __init__(self, redis: Redis, key: str, owner: str, ttl_s: float) -> None:
        self.redis = redis
        self.key = key
        self.owner = owner
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._acquire = redis.register_script(_ACQUIRE)
        self._release = redis.register_script(_RELEASE)

    async def hold(self) -> bool:
        """Take or renew the lease; True while this scaler is the leader."""
        return bool(await self._acquire(keys=[self.key], args=[self.owner, self.ttl_ms]))

    async def release(self) -> None:
        """Give the lease up at once so a standby need not wait for it to expire."""
        await self._release(keys=[self.key], args=[self.owner])

    async def holder(self) -> str | None:
        v = await self.redis.get(self.key)
        return v.decode() if isinstance(v, bytes) else v
