"""Chains as a whole: how each agent chain (`X-Chain-Id`) of the fleet ended, for the status page
and the metrics (docs/fair-line.md).

Keys, all under the hash tag `{chains}` of the namespace (one slot: the scripts run on a Redis
Cluster):

- `open` HASH chain -> "first ms|calls open|bad|tier|class": a chain seen, with when its first
  call came, its calls not yet ended, whether any was refused or late, and the tier and class
  of its first call (what the metrics count it under: no label per chain);
- `idle` ZSET chain -> when its last call ended, for the chains with no call open;
- `done` HASH "completed|<tier>|<class>" and "refused_or_late|<tier>|<class>" -> chains;
- `times` LIST of the last 1,000 chains' completion times in ms (first call in, last call out).

A chain is complete once no call of it has been open for `idle_s`: the gateway cannot know a
chain's last call, only that it went quiet. Writer: the gateway's `Call` (a call starts, a call
ends) and its reaper (`sweep`); reader: `read_chains` (status, metrics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.store.lua import CLOCK

# KEYS: open idle ; ARGV: chain tier class
START = CLOCK + """
local rec = redis.call('HGET', KEYS[1], ARGV[1])
if rec then
  local first, open, bad, rest = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  rec = first .. '|' .. (tonumber(open) + 1) .. '|' .. bad .. '|' .. rest
else
  rec = n2s(now) .. '|1|0|' .. ARGV[2] .. '|' .. ARGV[3]
end
redis.call('HSET', KEYS[1], ARGV[1], rec)
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: open idle ; ARGV: chain bad(0|1)
END = CLOCK + """
local rec = redis.call('HGET', KEYS[1], ARGV[1])
if not rec then return 0 end
local first, open, bad, rest = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
open = math.max(0, tonumber(open) - 1)
if ARGV[2] == '1' then bad = '1' end
redis.call('HSET', KEYS[1], ARGV[1], first .. '|' .. open .. '|' .. bad .. '|' .. rest)
if open == 0 then redis.call('ZADD', KEYS[2], n2s(now), ARGV[1]) end
return 1
"""

# KEYS: open idle done times ; ARGV: idle_ms batch ; returns chains completed now
SWEEP = CLOCK + """
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', n2s(now - tonumber(ARGV[1])), 'WITHSCORES', 'LIMIT', 0,
  tonumber(ARGV[2]))
for i = 1, #gone, 2 do
  local chain, last = gone[i], tonumber(gone[i + 1])
  local rec = redis.call('HGET', KEYS[1], chain)
  if rec then
    local first, open, bad, tier, cls = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
    redis.call('HINCRBY', KEYS[3], 'completed|' .. tier .. '|' .. cls, 1)
    if bad == '1' then redis.call('HINCRBY', KEYS[3], 'refused_or_late|' .. tier .. '|' .. cls, 1) end
    redis.call('LPUSH', KEYS[4], n2s(last - tonumber(first)))
    redis.call('LTRIM', KEYS[4], 0, 999)
    redis.call('HDEL', KEYS[1], chain)
  end
  redis.call('ZREM', KEYS[2], chain)
end
return #gone / 2
"""


@dataclass(frozen=True, slots=True)
class ChainOutcomes:
    """The fleet's chains: open now, completed and refused-or-late by (tier, class) of their first
    call, and the completion time p50/p99 of the last 1,000 completed (seconds; None: none yet)."""

    open: int
    completed: dict[tuple[str, str], int]
    refused_or_late: dict[tuple[str, str], int]
    p50_s: float | None
    p99_s: float | None


class Chains:
    """One namespace's chain records (scripts registered once)."""

    def __init__(self, redis: Redis, namespace: str) -> None:
        self.redis = redis
        k = f"{namespace}:{{chains}}:"
        self.keys = [k + "open", k + "idle", k + "done", k + "times"]
        self._start = redis.register_script(START)
        self._end = redis.register_script(END)
        self._sweep = redis.register_script(SWEEP)

    async def start(self, chain: str, tier: str, cls: str) -> None:
        await self._start(keys=self.keys[:2], args=[chain, tier, cls])

    async def end(self, chain: str, bad: bool) -> None:
        await self._end(keys=self.keys[:2], args=[chain, "1" if bad else "0"])

    async def sweep(self, idle_s: float, batch: int = 500) -> int:
        """Count as completed the chains with no call open for `idle_s`."""
        return int(await self._sweep(keys=self.keys, args=[int(idle_s * 1000), batch]))


async def read_chains(redis: Redis, namespace: str) -> ChainOutcomes:
    k = f"{namespace}:{{chains}}:"
    async with redis.pipeline(transaction=False) as p:
        p.hlen(k + "open").hgetall(k + "done").lrange(k + "times", 0, -1)
        n_open, done, times = await p.execute()
    by: dict[str, dict[tuple[str, str], int]] = {"completed": {}, "refused_or_late": {}}
    for field, n in done.items():
        what, tier, cls = (field.decode() if isinstance(field, bytes) else field).split("|", 2)
        by[what][(tier, cls)] = int(n)
    ms = sorted(int(t) for t in times)
    return ChainOutcomes(int(n_open), by["completed"], by["refused_or_late"], _pct(ms, 0.5), _pct(ms, 0.99))


def _pct(ms: list[int], q: float) -> float | None:
    """Nearest-rank percentile of sorted milliseconds, in seconds."""
    return ms[min(len(ms) - 1, max(0, math.ceil(q * len(ms)) - 1))] / 1000 if ms else None
