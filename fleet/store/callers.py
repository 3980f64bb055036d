"""Who answers for each call: the gateway process a request's caller waits on, recorded in Redis.

A gateway that tells its callers 503 while Redis is away ends their requests once Redis answers
again (`gateway.redis_loss.Orphans`), so nothing is served that nobody will read. Kept only in
that gateway's memory, the promise died with it: a gateway restarted during the outage left its
callers' requests in the line, and the workers served them for nobody. So every call is recorded,
in the same step as its enqueue, under the gateway process that answers for it, and a gateway
that stops renewing its lease has its calls ended by the others.

Keys (a tier's hash tag, so the scripts run on one cluster slot):

- `callers` HASH gateway id -> "lease expiry ms|suspected since ms" (Redis clock). Written by
  ENQUEUE (every call renews its gateway's lease) and by `SWEEP` (each gateway's beat renews its
  own, and marks or clears the others').
- `calls:<gateway id>` ZSET request id -> deadline ms: the calls that gateway answers for and
  that have not ended. ENQUEUE adds, every end of a request (`retire` in the line's scripts)
  removes, `SWEEP` ends what is left of a gateway that is gone.
- the request hash's `gw` field: which set holds it.

A lease that ran out is only suspected at first: a frozen Redis wakes with every lease run out
while their gateways live, and they renew at their next beat. A gateway whose lease is still out
`GRACE_MS` of Redis time after it was suspected is gone: its calls are ended with outcome
`unavailable` (queued ones leave the line; running ones are aborted in their engine through the
cancel channel), a bounded number per sweep, and its entry goes once none is left.

Writers: the line's scripts (ENQUEUE, the retire of every end) and SWEEP, which
`fleet.store.line.Line.reap` runs for a gateway (`fleet.store.line_scripts` assembles both
from the pieces here). Reader: `read_callers` (tests, operators).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.store.keys import TierKeys

LEASE_MS = 10_000  # a gateway renews at each enqueue and each beat; this long without, it is suspected
GRACE_MS = 3_000  # suspected this long (Redis time, Redis answering) without a renewal: it is gone
SWEEP_BATCH = 200  # calls of a gone gateway ended per sweep

# After CLOCK, at the head of ENQUEUE. ARGV[10]: the gateway answering for the call ('' for none:
# tests and benches enqueue directly), ARGV[11]: its lease (ms). KEYS[6] is the request's hash.
MARK = """
if ARGV[10] and ARGV[10] ~= '' then
  local prefix = string.sub(KEYS[6], 1, #KEYS[6] - #ARGV[1] - 4)
  local calls = prefix .. 'calls:' .. ARGV[10]
  local keep = tonumber(ARGV[4]) + tonumber(ARGV[7]) * 1000
  redis.call('HSET', KEYS[6], 'gw', ARGV[10])
  redis.call('ZADD', calls, n2s(now + tonumber(ARGV[4])), ARGV[1])
  if redis.call('PTTL', calls) < keep then redis.call('PEXPIRE', calls, keep) end
  redis.call('HSET', prefix .. 'callers', ARGV[10], n2s(now + tonumber(ARGV[11])) .. '|')
end
"""

# A Lua function for the line's `retire`: the ended request `rid` of hash `req` leaves its
# gateway's set (`gw`: the hash's field, or false).
UNMARK = """
local function unmark(req, rid, gw)
  if gw then redis.call('ZREM', string.sub(req, 1, #req - #rid - 4) .. 'calls:' .. gw, rid) end
end
"""

# The body of the line's SWEEP (after its clock and `retire`).
# KEYS: callers line inflight counters ; ARGV: prefix me lease_ms grace_ms batch ttl_s channel
# Renews the lease of `me` (this gateway), then judges every other entry (see the module doc).
# Returns the number of calls it ended.
SWEEP_BODY = """
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], n2s(now + tonumber(ARGV[3])) .. '|') end
local ended = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local gw, lease, since = all[i], string.match(all[i + 1], '^(%d*)|(%d*)$')
  if gw ~= ARGV[2] and lease and tonumber(lease) < now then
    if since == '' then
      redis.call('HSET', KEYS[1], gw, lease .. '|' .. n2s(now))
    elseif now - tonumber(since) >= tonumber(ARGV[4]) then
      local calls = ARGV[1] .. 'calls:' .. gw
      for _, rid in ipairs(redis.call('ZRANGE', calls, 0, tonumber(ARGV[5]) - 1)) do
        local req = ARGV[1] .. 'req:' .. rid
        local state = redis.call('HGET', req, 'state')
        redis.call('ZREM', calls, rid)
        if state == 'queued' or state == 'running' then
          redis.call('ZREM', KEYS[2], rid)
          redis.call('ZREM', KEYS[3], rid)
          retire(req, rid, 'unavailable', tonumber(ARGV[6]))
          redis.call('HINCRBY', KEYS[4], 'unavailable', 1)
          if state == 'running' then redis.call('PUBLISH', ARGV[7], rid) end
          ended = ended + 1
        end
      end
      if redis.call('ZCARD', calls) == 0 then redis.call('HDEL', KEYS[1], gw) end
    end
  end
end
return ended
"""


@dataclass(frozen=True, slots=True)
class CallerLease:
    """One gateway process's entry in `callers`."""

    gateway: str
    lease_until_ms: int
    suspected_since_ms: int | None  # its lease ran out, seen then; None while it renews

    @classmethod
    def parse(cls, gateway: str, raw: str) -> CallerLease:
        lease, _, since = raw.partition("|")
        return cls(gateway, int(lease or 0), int(since) if since else None)


async def read_callers(redis: Any, keys: TierKeys) -> list[CallerLease]:
    """Every gateway entry of the tier, in no order."""
    raw = await redis.hgetall(keys.callers)
    return [CallerLease.parse(_s(k), _s(v)) for k, v in raw.items()]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
