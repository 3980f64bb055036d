"""The scaler's leader lease: `scaler_leader_key`, only one scaler acts at a time.

Writer: the scalers (`Lease.hold`, `Lease.release`): a standby takes over when
the leader stops renewing. Reader: anyone asking whether a scaler acts now
(`leader_of`): the gateway ticks the budget governor itself only while none does.

SET NX PX takes the lease; the holder renews it every tick with a
compare-and-expire script, so a scaler that lost it (paused, partitioned)
can never extend someone else's lease, and finds out at its next tick.
"""

from __future__ import annotations

from redis.asyncio import Redis

from fleet.store.keys import scaler_leader_key
from fleet.store.lua import SHEBANG

# Renew if we hold it, else take it if it is free: one round trip, atomic.
_ACQUIRE = SHEBANG + """
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

_RELEASE = SHEBANG + """
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


async def leader_of(redis: Redis, namespace: str) -> str | None:
    """The id of the scaler holding the lease, or None when no scaler acts."""
    v = await redis.get(scaler_leader_key(namespace))
    return v.decode() if isinstance(v, bytes) else v
