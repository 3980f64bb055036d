"""The line: one Redis priority queue per tier, with leases, in a few atomic Lua scripts.

Shape (all keys of a tier share its hash tag, see `fleet.keys`):

- `line` ZSET, score = class rank * CLASS_SPAN + arrival sequence, so ZPOPMIN
  gives strict class order and first come first served within a class. A
  requeued request keeps its score, so it goes back ahead of everything that
  arrived after it: the head of its class.
- `inflight` ZSET, score = lease expiry on the Redis clock. Workers renew
  leases while they run (streams last minutes; a fixed visibility timeout
  would re-run long jobs); a reaper requeues what expired.
- `req:<id>` HASH, the request and its state. `state` moves queued -> running
  -> done, and only `finish` sets done, once: that is what makes every
  accepted request end in exactly one outcome.
- `res:<id>` STREAM of events for the caller, with a TTL so unread results
  cannot pile up.

Deadlines are absolute on the Redis clock, set from the relative
X-Deadline-Ms at enqueue, so gateway and worker clocks need not agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.keys import TierKeys

CLASS_SPAN = 10**15  # arrival sequences stay below this; ranks * span stay exact in a double
OUTCOMES = ("completed", "expired", "cancelled", "failed")

LUA_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Redis turns Lua numbers into strings with 14 significant digits; scores
-- need all 16, so every number bound for Redis goes through n2s.
local function n2s(x) return string.format('%.0f', x) end
"""

# After LUA_NOW. Reads KEYS[1] (the line) and ARGV[2] (the key prefix); sets
# `by_class` (requests waiting per class, highest first) and `oldest_enq` (when
# the longest waiter joined, or now). Shared by `observe` and the gateway's admission.
LUA_BY_CLASS = """
local by_class, oldest_enq = {}, now
for rank = 0, 3 do
  local lo, hi = n2s(rank * 1e15), '(' .. n2s((rank + 1) * 1e15)
  by_class[#by_class + 1] = redis.call('ZCOUNT', KEYS[1], lo, hi)
  local head = redis.call('ZRANGEBYSCORE', KEYS[1], lo, hi, 'LIMIT', 0, 1)
  if #head > 0 then
    local enq = tonumber(redis.call('HGET', ARGV[2] .. 'req:' .. head[1], 'enq') or now)
    if enq < oldest_enq then oldest_enq = enq end
  end
end
"""

_EVENT = """
local function emit(res, ev, ttl)
  redis.call('XADD', res, '*', 'e', ev)
  redis.call('EXPIRE', res, ttl)
end
"""

# KEYS: line seq bell counters arrivals req [admitting]
# ARGV: rid rank payload deadline_rel_ms priority chain ttl_s window_ms [admitting member]
ENQUEUE = LUA_NOW + """
local seq = redis.call('INCR', KEYS[2])
local score = n2s(tonumber(ARGV[2]) * 1e15 + seq)
local deadline = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[6], 'payload', ARGV[3], 'rank', ARGV[2], 'priority', ARGV[5], 'chain', ARGV[6],
  'deadline', n2s(deadline), 'enq', n2s(now), 'score', score, 'state', 'queued', 'attempt', 0, 'owner', '')
redis.call('PEXPIRE', KEYS[6], tonumber(ARGV[4]) + tonumber(ARGV[7]) * 1000)
redis.call('ZADD', KEYS[1], score, ARGV[1])
redis.call('LPUSH', KEYS[3], 1)
redis.call('LTRIM', KEYS[3], 0, 63)
redis.call('HINCRBY', KEYS[4], 'accepted', 1)
redis.call('ZADD', KEYS[5], n2s(now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', n2s(now - tonumber(ARGV[8])))
-- The gateway's "being admitted" mark: the line counts the request from now on.
if KEYS[7] then redis.call('ZREM', KEYS[7], ARGV[9]) end
return {n2s(deadline), n2s(now)}
"""

# KEYS: line inflight counters
# ARGV: n replica lease_ms prefix ttl_s
# The lease's owner is "<replica>:<attempt>": a replica that stalled past its
# lease and claimed the same request again must not renew, stream into or
# finish the new attempt with the old one.
CLAIM = LUA_NOW + _EVENT + """
local out = {}
local n = tonumber(ARGV[1])
local pops = 0
while #out < n and pops < 4 * n + 16 do
  pops = pops + 1
  local head = redis.call('ZPOPMIN', KEYS[1])
  if #head == 0 then break end
  local rid = head[1]
  local req = ARGV[4] .. 'req:' .. rid
  local f = redis.call('HMGET', req, 'state', 'deadline', 'payload', 'attempt', 'enq', 'priority')
  if not f[1] then
    -- Its hash outlived its deadline by the result TTL: it expired, unseen.
    redis.call('HINCRBY', KEYS[3], 'expired', 1)
  elseif f[1] == 'queued' then
    if tonumber(f[2]) <= now then
      -- A request whose deadline passed in the line never reaches an engine.
      redis.call('HSET', req, 'state', 'done', 'outcome', 'expired')
      redis.call('HINCRBY', KEYS[3], 'expired', 1)
      emit(ARGV[4] .. 'res:' .. rid, cjson.encode({t='err', status=504, type='deadline_exceeded',
        msg='deadline passed while waiting in the line'}), tonumber(ARGV[5]))
    else
      local attempt = tonumber(f[4]) + 1
      local owner = ARGV[2] .. ':' .. attempt
      redis.call('HSET', req, 'state', 'running', 'owner', owner, 'attempt', attempt, 'claimed', n2s(now))
      redis.call('ZADD', KEYS[2], n2s(now + tonumber(ARGV[3])), rid)
      out[#out + 1] = {rid, f[3], attempt, n2s(tonumber(f[2]) - now), n2s(now - tonumber(f[5])), f[6], owner}
    end
  end
end
return out
"""

# KEYS: inflight ; ARGV: lease_ms prefix (rid owner)...
RENEW = LUA_NOW + """
local lost = {}
for i = 3, #ARGV, 2 do
  local rid = ARGV[i]
  local f = redis.call('HMGET', ARGV[2] .. 'req:' .. rid, 'state', 'owner')
  if f[1] == 'running' and f[2] == ARGV[i + 1] then
    redis.call('ZADD', KEYS[1], 'XX', n2s(now + tonumber(ARGV[1])), rid)
  else
    lost[#lost + 1] = rid
  end
end
return lost
"""

# KEYS: line inflight counters completions req res
# ARGV: rid outcome owner event ttl_s window_ms prompt_tokens completion_tokens channel
FINISH = LUA_NOW + _EVENT + """
local f = redis.call('HMGET', KEYS[5], 'state', 'owner')
if not f[1] or f[1] == 'done' then return '' end
if ARGV[3] ~= '' and f[2] ~= ARGV[3] then return '' end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[5], 'state', 'done', 'outcome', ARGV[2])
redis.call('EXPIRE', KEYS[5], tonumber(ARGV[5]))
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
if ARGV[2] == 'completed' then
  redis.call('ZADD', KEYS[4], n2s(now), ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', n2s(now - tonumber(ARGV[6])))
  redis.call('HINCRBY', KEYS[3], 'prompt_tokens', tonumber(ARGV[7]))
  redis.call('HINCRBY', KEYS[3], 'completion_tokens', tonumber(ARGV[8]))
end
if ARGV[4] ~= '' then emit(KEYS[6], ARGV[4], tonumber(ARGV[5])) end
if f[1] == 'running' and ARGV[3] == '' then
  -- Someone other than the owner ended it (cancel, deadline): abort it in the engine.
  redis.call('PUBLISH', ARGV[9], ARGV[1])
end
return f[1]
"""

# KEYS: inflight (only to route the call to the tier's slot; the rest share its hash tag)
# ARGV: prefix ttl_s (rid owner first event)...
# Tokens are written only while their writer still holds the lease, so a
# replica whose lease was reaped cannot interleave its text with the next
# attempt's. Returns the positions of the entries whose lease is gone.
EMIT = """
local lost = {}
for i = 3, #ARGV, 4 do
  local rid = ARGV[i]
  local req = ARGV[1] .. 'req:' .. rid
  local f = redis.call('HMGET', req, 'state', 'owner')
  if f[1] == 'running' and f[2] == ARGV[i + 1] then
    if ARGV[i + 2] == '1' then redis.call('HSET', req, 'streamed', '1') end
    local res = ARGV[1] .. 'res:' .. rid
    redis.call('XADD', res, '*', 'e', ARGV[i + 3])
    redis.call('EXPIRE', res, tonumber(ARGV[2]))
  else
    lost[#lost + 1] = (i - 3) / 4
  end
end
return lost
"""

# KEYS: inflight line counters bell dead ; ARGV: prefix max_attempts ttl_s
REAP = LUA_NOW + _EVENT + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', n2s(now), 'LIMIT', 0, 200)
local requeued, lost = 0, 0
for _, rid in ipairs(expired) do
  redis.call('ZREM', KEYS[1], rid)
  local req = ARGV[1] .. 'req:' .. rid
  local f = redis.call('HMGET', req, 'state', 'streamed', 'attempt', 'score')
  if f[1] == 'running' then
    local res = ARGV[1] .. 'res:' .. rid
    if f[2] == '1' then
      -- Tokens already reached the caller: a rerun would duplicate them.
      redis.call('HSET', req, 'state', 'done', 'outcome', 'failed')
      redis.call('HINCRBY', KEYS[3], 'failed', 1)
      emit(res, cjson.encode({t='err', status=502, type='worker_lost',
        msg='the worker serving this stream was lost'}), tonumber(ARGV[3]))
      lost = lost + 1
    elseif tonumber(f[3]) >= tonumber(ARGV[2]) then
      redis.call('HSET', req, 'state', 'done', 'outcome', 'failed')
      redis.call('HINCRBY', KEYS[3], 'failed', 1)
      redis.call('LPUSH', KEYS[5], rid)
      redis.call('LTRIM', KEYS[5], 0, 999)
      emit(res, cjson.encode({t='err', status=502, type='worker_lost',
        msg='the request was lost by ' .. f[3] .. ' workers in a row; it was set aside'}), tonumber(ARGV[3]))
      lost = lost + 1
    else
      redis.call('HSET', req, 'state', 'queued', 'owner', '')
      redis.call('ZADD', KEYS[2], f[4], rid)
      redis.call('LPUSH', KEYS[4], 1)
      redis.call('HINCRBY', KEYS[3], 'requeued', 1)
      requeued = requeued + 1
    end
  end
end
return {requeued, lost}
"""

# KEYS: line inflight counters arrivals completions ; ARGV: window_ms prefix
OBSERVE = LUA_NOW + LUA_BY_CLASS + """
local oldest = now - oldest_enq
local since = n2s(now - tonumber(ARGV[1]))
return {n2s(now), by_class, n2s(oldest), redis.call('ZCARD', KEYS[2]),
  redis.call('ZCOUNT', KEYS[4], since, '+inf'), redis.call('ZCOUNT', KEYS[5], since, '+inf'),
  redis.call('HGETALL', KEYS[3])}
"""


@dataclass(slots=True)
class Claimed:
    rid: str
    payload: dict[str, Any]
    attempt: int
    remaining_ms: int  # time left to the deadline at claim, on the Redis clock
    waited_ms: int
    priority: str
    owner: str  # this attempt's lease on the request: "<replica>:<attempt>"

    @property
    def lease(self) -> str:
        """Names this attempt of this request uniquely within a replica."""
        return f"{self.rid}@{self.owner}"


@dataclass(slots=True)
class LineSnapshot:
    """What the line looks like now; the raw counts the policy reads."""

    now_ms: int
    by_class: tuple[int, int, int, int]
    oldest_wait_s: float
    inflight: int
    arrivals_in_window: int
    completions_in_window: int
    counters: dict[str, int]

    @property
    def waiting(self) -> int:
        return sum(self.by_class)

    def ahead_of(self, priority: Priority) -> int:
        """Requests a new arrival of this class would wait behind."""
        return sum(self.by_class[: priority + 1])


class Line:
    """One tier's line. Safe to share across tasks; every mutation is one Lua call."""

    def __init__(self, redis: Redis, namespace: str, tier: str, *, result_ttl_s: int = 300,
                 rate_window_s: float = 10.0) -> None:
        self.redis = redis
        self.tier = tier
        self.keys = TierKeys(namespace, tier)
        self.prefix = self.keys.request("")[: -len("req:")]
        self.result_ttl_s = result_ttl_s
        self.window_ms = int(rate_window_s * 1000)
        self._enqueue = redis.register_script(ENQUEUE)
        self._claim = redis.register_script(CLAIM)
        self._renew = redis.register_script(RENEW)
        self._finish = redis.register_script(FINISH)
        self._reap = redis.register_script(REAP)
        self._observe = redis.register_script(OBSERVE)
        self._emit = redis.register_script(EMIT)

    async def enqueue(self, rid: str, priority: Priority, payload: bytes, deadline_ms: int,
                      chain: str = "", admitting: tuple[str, str] | None = None) -> int:
        """Join the line; returns the absolute deadline on the Redis clock.

        `admitting` (key, member): the admission mark this request held, dropped
        in the same step, so no instant counts it twice or not at all.
        """
        k = self.keys
        keys = [k.line, k.seq, k.bell, k.counters, k.arrivals, k.request(rid)]
        args: list[Any] = [rid, int(priority), payload, deadline_ms, priority.name, chain, self.result_ttl_s,
                           self.window_ms]
        if admitting:
            keys.append(admitting[0])
            args.append(admitting[1])
        deadline, _ = await self._enqueue(keys=keys, args=args)
        return int(deadline)

    async def claim(self, replica: str, n: int, lease_s: float) -> list[Claimed]:
        if n <= 0:
            return []
        k = self.keys
        rows = await self._claim(keys=[k.line, k.inflight, k.counters],
                                 args=[n, replica, int(lease_s * 1000), self.prefix, self.result_ttl_s])
        return [
            Claimed(rid=_s(r[0]), payload=orjson.loads(r[1]), attempt=int(r[2]), remaining_ms=int(r[3]),
                    waited_ms=int(r[4]), priority=_s(r[5]), owner=_s(r[6]))
            for r in rows
        ]

    async def renew(self, held: list[tuple[str, str]], lease_s: float) -> list[str]:
        """Extend the leases of running requests, (rid, owner) each; returns the rids no longer held."""
        if not held:
            return []
        args: list[Any] = [int(lease_s * 1000), self.prefix]
        for rid, owner in held:
            args += [rid, owner]
        lost = await self._renew(keys=[self.keys.inflight], args=args)
        return [_s(r) for r in lost]

    async def finish(self, rid: str, outcome: str, event: dict[str, Any] | None = None, *, owner: str = "",
                     prompt_tokens: int = 0, completion_tokens: int = 0) -> str | None:
        """End a request with one outcome. Only the first call for a request wins.

        Returns the state it ended it from ("queued": no engine saw it;
        "running": an engine had it), or None if it was already ended, or
        `owner` no longer holds it.

        `owner` set: only if that attempt still holds the lease (a worker whose
        lease was reaped must not complete a request someone else now runs).
        `owner` empty: the gateway ending it (cancel, deadline); a running
        request is then aborted in its engine through the cancel channel.
        """
        k = self.keys
        ok = await self._finish(
            keys=[k.line, k.inflight, k.counters, k.completions, k.request(rid), k.result(rid)],
            args=[rid, outcome, owner, orjson.dumps(event) if event else "", self.result_ttl_s, self.window_ms,
                  prompt_tokens, completion_tokens, k.cancel_channel],
        )
        return _s(ok) or None

    async def reap(self, max_attempts: int = 3) -> tuple[int, int]:
        """Requeue requests whose lease expired; returns (requeued, lost)."""
        k = self.keys
        requeued, lost = await self._reap(keys=[k.inflight, k.line, k.counters, k.bell, k.dead],
                                          args=[self.prefix, max_attempts, self.result_ttl_s])
        return int(requeued), int(lost)

    async def observe(self) -> LineSnapshot:
        k = self.keys
        now, by_class, oldest, inflight, arrivals, completions, counters = await self._observe(
            keys=[k.line, k.inflight, k.counters, k.arrivals, k.completions], args=[self.window_ms, self.prefix])
        flat = [_s(x) for x in counters]
        return LineSnapshot(
            now_ms=int(now), by_class=tuple(int(c) for c in by_class),  # type: ignore[arg-type]
            oldest_wait_s=int(oldest) / 1000, inflight=int(inflight), arrivals_in_window=int(arrivals),
            completions_in_window=int(completions),
            counters={flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)},
        )

    async def emit(self, tokens: list[tuple[str, str, dict[str, Any], bool]]) -> list[int]:
        """Append token events to result streams in one round trip: (rid, owner,
        event, first) each. Returns the positions of the entries whose owner no
        longer holds its lease (nothing was written for those).

        A request's first streamed token also marks it `streamed`, in the same
        step: from then on a lost worker means `worker_lost` for the caller,
        never a silent rerun that would send tokens twice.
        """
        if not tokens:
            return []
        args: list[Any] = [self.prefix, self.result_ttl_s]
        for rid, owner, event, first in tokens:
            args += [rid, owner, "1" if first else "0", orjson.dumps(event)]
        return [int(i) for i in await self._emit(keys=[self.keys.inflight], args=args)]

    async def wait_for_work(self, timeout_s: float) -> None:
        """Block until an enqueue rings the bell or the timeout passes."""
        await self.redis.blpop([self.keys.bell], timeout=timeout_s)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
