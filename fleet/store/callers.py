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

Writers: the line's scripts (ENQUEUE with `MARK`, the retire of every end in
`fleet.store.line_lua`) and SWEEP, which `fleet.store.line.Line.reap` runs for a gateway.
Reader: `read_callers` (tests, operators).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.store.keys import TierKeys
from fleet.store.line_lua import LINE_CONSTS, RETIRE
from fleet.store.lua import Script

LEASE_MS = 10_000  # a gateway renews at each enqueue and each beat; this long without, it is suspected
GRACE_MS = 3_000  # suspected this long (Redis time, Redis answering) without a renewal: it is gone
SWEEP_BATCH = 200  # calls of a gone gateway ended per sweep

# A Lua function for ENQUEUE: the call `rid` (hash `req`) is recorded under `gateway`, which
# answers for it until its deadline (ms, Redis clock), the set kept `keep_ms`; the gateway's
# lease in `callers` is renewed for `lease_ms`.
MARK = """
local function mark_caller(callers, req, rid, gateway, deadline, keep_ms, lease_ms)
  local calls = calls_key(gateway)
  redis.call('HSET', req, 'gw', gateway)
  redis.call('ZADD', calls, n2s(deadline), rid)
  if redis.call('PTTL', calls) < keep_ms then redis.call('PEXPIRE', calls, keep_ms) end
  redis.call('HSET', callers, gateway, n2s(now + lease_ms) .. '|')
end
"""

# Renew this gateway's (`me`) caller lease, then judge every other entry (see the module doc).
# Run by `fleet.store.line.Line.reap` for a gateway. Returns the number of calls it ended.
SWEEP = Script("SWEEP", keys=("callers", "line", "inflight", "counters"),
               args=("prefix", "me", "lease_ms", "grace_ms", "batch", "ttl_s", "channel"),
               consts=LINE_CONSTS, uses=(RETIRE,), body="""
if me ~= '' then redis.call('HSET', callers, me, n2s(now + tonumber(lease_ms)) .. '|') end
local ended = 0
local all = redis.call('HGETALL', callers)
for i = 1, #all, 2 do
  local gw, lease, since = all[i], string.match(all[i + 1], '^(%d*)|(%d*)$')
  if gw ~= me and lease and tonumber(lease) < now then
    if since == '' then
      redis.call('HSET', callers, gw, lease .. '|' .. n2s(now))
    elseif now - tonumber(since) >= tonumber(grace_ms) then
      local calls = calls_key(gw)
      for _, rid in ipairs(redis.call('ZRANGE', calls, 0, tonumber(batch) - 1)) do
        local req = request_key(rid)
        local state = redis.call('HGET', req, 'state')
        redis.call('ZREM', calls, rid)
        if state == 'queued' or state == 'running' then
          redis.call('ZREM', line, rid)
          redis.call('ZREM', inflight, rid)
          retire(req, rid, OUTCOME_UNAVAILABLE, tonumber(ttl_s))
          redis.call('HINCRBY', counters, OUTCOME_UNAVAILABLE, 1)
          if state == 'running' then redis.call('PUBLISH', channel, rid) end
          ended = ended + 1
        end
      end
      if redis.call('ZCARD', calls) == 0 then redis.call('HDEL', callers, gw) end
    end
  end
end
return ended
""")


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
