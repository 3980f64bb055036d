"""Chains as a whole: how each agent chain (`X-Chain-Id`) of the fleet ended, for the status page
and the metrics (docs/fair-line.md).

Keys, all under the hash tag `{chains}` of the namespace (one slot: the scripts run on a Redis
Cluster):

- `open` HASH chain -> "first ms|calls open|bad|tier|class": a chain seen, with when its first
  call came, its calls not yet ended, whether any was refused or late, and the tier and class
  of its first call (what the metrics count it under: no label per chain);
- `idle` ZSET chain -> when its last call ended, for the chains with no call open;
- `done` HASH "completed|<tier>|<class>" and "refused_or_late|<tier>|<class>" -> chains;
- `times` LIST of the last 1,000 chains' completion times in ms (first call in, last call out);
- `deadline` HASH chain -> the chain's deadline, epoch ms on the Redis clock: the first call that
  sent `X-Chain-Deadline-Ms` set it, and every later call is judged on what is left of it;
- `owner` HASH chain -> the name of the API key whose call opened it (who may cancel it);
- `cancelled` ZSET chain -> until when (ms) new calls of a chain cancelled whole are refused;
- `calls:<chain>` SET "tier|request id" of the chain's calls not yet ended (what a cancel ends);
- `served` HASH chain -> 1 once a call of it completed: the chain is under way.

A chain is complete once no call of it has been open for `idle_s`: the gateway cannot know a
chain's last call, only that it went quiet. Writer: the gateway's `Call` (a call starts, a call
ends) and its reaper (`sweep`); reader: `read_chains` (status, metrics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.store.lua import CLOCK

# A call of the chain starts: refused while the chain is cancelled; else counted open, the
# chain's deadline set if it has none, and the call listed for a cancel.
# Returns {0, ms left of the chain's deadline (-1: none), under way (1: a call of it was served or
# is open)} or {1, ms until the chain may be used again} when it is cancelled.
START = CLOCK + """
local open_key, idle_key, deadline_key, owner_key, cancelled_key, calls_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5], KEYS[6]
local served_key = KEYS[7]
local chain, tier, cls, want_ms, member, owner = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
redis.call('ZREMRANGEBYSCORE', cancelled_key, '-inf', n2s(now))
local till = redis.call('ZSCORE', cancelled_key, chain)
if till then return {1, n2s(tonumber(till) - now), 0} end
local rec = redis.call('HGET', open_key, chain)
local under_way = 0
if rec then
  local first, open, bad, rest = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  if tonumber(open) > 0 or redis.call('HEXISTS', served_key, chain) == 1 then under_way = 1 end
  rec = first .. '|' .. (tonumber(open) + 1) .. '|' .. bad .. '|' .. rest
else
  rec = n2s(now) .. '|1|0|' .. tier .. '|' .. cls
  redis.call('HSET', owner_key, chain, owner)
end
redis.call('HSET', open_key, chain, rec)
redis.call('ZREM', idle_key, chain)
local at = redis.call('HGET', deadline_key, chain)
if not at and want_ms > 0 then
  at = n2s(now + want_ms)
  redis.call('HSET', deadline_key, chain, at)
end
redis.call('SADD', calls_key, member)
redis.call('PEXPIRE', calls_key, 86400000)
local left = -1
if at then left = math.max(0, tonumber(at) - now) end
return {0, n2s(left), under_way}
"""

# A call of the chain ended (bad: refused or late).
END = CLOCK + """
local open_key, idle_key, calls_key, served_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local chain, bad_now, member, served = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
redis.call('SREM', calls_key, member)
if served == '1' then redis.call('HSET', served_key, chain, 1) end
local rec = redis.call('HGET', open_key, chain)
if not rec then return 0 end
local first, open, bad, rest = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
open = math.max(0, tonumber(open) - 1)
if bad_now == '1' then bad = '1' end
redis.call('HSET', open_key, chain, first .. '|' .. open .. '|' .. bad .. '|' .. rest)
if open == 0 then redis.call('ZADD', idle_key, n2s(now), chain) end
return 1
"""

# The chain cancelled whole: new calls refused for `hold_ms`; its calls not yet ended, returned
# for the gateway to end in their lines. Only its owner's key (or an admin: owner '') may.
# Returns {0, calls...}, {1} (not its owner) or {2} (no such chain).
CANCEL = CLOCK + """
local open_key, owner_key, cancelled_key, calls_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local chain, hold_ms, who = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local owner = redis.call('HGET', owner_key, chain)
if not owner and redis.call('HEXISTS', open_key, chain) == 0 then return {2} end
if who ~= '' and owner and owner ~= who then return {1} end
redis.call('ZADD', cancelled_key, n2s(now + hold_ms), chain)
local out = {0}
for _, m in ipairs(redis.call('SMEMBERS', calls_key)) do out[#out + 1] = m end
redis.call('DEL', calls_key)
return out
"""

# KEYS: open idle done times deadline owner served ; ARGV: idle_ms batch ; returns chains completed now
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
  redis.call('HDEL', KEYS[5], chain)
  redis.call('HDEL', KEYS[6], chain)
  redis.call('HDEL', KEYS[7], chain)
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


@dataclass(frozen=True, slots=True)
class ChainStart:
    """What a call learns of its chain as it starts."""

    cancelled_for_ms: int | None = None  # the chain was cancelled whole: refused for this long yet
    left_ms: int | None = None  # what is left of the chain's deadline; None: it has none
    under_way: bool = False  # an earlier call of it was served, or one is open: not a new chain


class Chains:
    """One namespace's chain records (scripts registered once)."""

    def __init__(self, redis: Redis, namespace: str) -> None:
        self.redis = redis
        self._k = k = f"{namespace}:{{chains}}:"
        self.keys = [k + "open", k + "idle", k + "done", k + "times", k + "deadline", k + "owner", k + "served",
                     k + "cancelled"]
        self._start = redis.register_script(START)
        self._end = redis.register_script(END)
        self._cancel = redis.register_script(CANCEL)
        self._sweep = redis.register_script(SWEEP)

    def calls_key(self, chain: str) -> str:
        return f"{self._k}calls:{chain}"

    async def start(self, chain: str, tier: str, cls: str, *, member: str = "", deadline_ms: int | None = None,
                    owner: str = "") -> ChainStart:
        """A call (`member`: "tier|request id") of the chain starts; `deadline_ms` sets the chain's
        deadline if it has none yet; `owner`: the key name that opens it, if it is new."""
        open_, idle, _, _, deadline, owners, served, cancelled = self.keys
        raw = await self._start(keys=[open_, idle, deadline, owners, cancelled, self.calls_key(chain), served],
                                args=[chain, tier, cls, deadline_ms or 0, member, owner])
        if int(raw[0]) == 1:
            return ChainStart(cancelled_for_ms=max(1, int(raw[1])))
        left = int(raw[1])
        return ChainStart(left_ms=None if left < 0 else left, under_way=int(raw[2]) == 1)

    async def end(self, chain: str, bad: bool, member: str = "", served: bool = False) -> None:
        """A call of the chain ended: `bad` refused or late; `served` completed (the chain is under way)."""
        await self._end(keys=[self.keys[0], self.keys[1], self.calls_key(chain), self.keys[6]],
                        args=[chain, "1" if bad else "0", member, "1" if served else "0"])

    async def cancel(self, chain: str, hold_ms: int, who: str) -> list[str] | int:
        """Cancel the chain whole (`who`: the caller's key name; "" for an admin): its calls not yet
        ended ("tier|request id"), or 1 (it is another key's chain) or 2 (no such chain)."""
        open_, _, _, _, _, owners, _, cancelled = self.keys
        raw = await self._cancel(keys=[open_, owners, cancelled, self.calls_key(chain)], args=[chain, hold_ms, who])
        if int(raw[0]) != 0:
            return int(raw[0])
        return [m.decode() if isinstance(m, bytes) else str(m) for m in raw[1:]]

    async def sweep(self, idle_s: float, batch: int = 500) -> int:
        """Count as completed the chains with no call open for `idle_s`."""
        return int(await self._sweep(keys=self.keys[:7], args=[int(idle_s * 1000), batch]))


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
