"""The line's Lua scripts: each mutation of a tier's line is one atomic script.

`fleet.store.line.Line` is their only caller; the layout they share is in its
module doc. Every script starts with the store's one clock preamble
(`fleet.store.lua.CLOCK`): `now` is the Redis server's time in ms.
"""

from __future__ import annotations

from fleet.store.callers import MARK, SWEEP_BODY, UNMARK
from fleet.store.events import EXPIRED_IN_LINE, REQUEST_LOST, SET_ASIDE, WORKER_LOST, lua_literal
from fleet.store.flows import FLOW_START
from fleet.store.lua import CLOCK, SHEBANG

CLASS_SPAN = 10**15  # arrival sequences stay below this; ranks * span stay exact in a double
# `unavailable`: the gateway told the caller 503 (Redis was away) and ended it once Redis answered again.
OUTCOMES = ("completed", "expired", "cancelled", "failed", "unavailable")

# After CLOCK. Reads KEYS[1] (the line) and ARGV[2] (the key prefix); sets
# `by_class` (requests waiting per class, highest first) and `oldest_enq` (when
# the longest waiter joined, or now). Shared by OBSERVE and the gateway's
# admission view (`fleet.store.admitting`).
LUA_BY_CLASS = """
local by_class, oldest_enq = {0, 0, 0, 0}, now
if redis.call('ZCARD', KEYS[1]) > 0 then  -- an empty line (the common case when idle) costs one call
  for rank = 0, 3 do
    local lo, hi = n2s(rank * 1e15), '(' .. n2s((rank + 1) * 1e15)
    by_class[rank + 1] = redis.call('ZCOUNT', KEYS[1], lo, hi)
    if by_class[rank + 1] > 0 then
      local head = redis.call('ZRANGEBYSCORE', KEYS[1], lo, hi, 'LIMIT', 0, 1)
      local enq = tonumber(redis.call('HGET', ARGV[2] .. 'req:' .. head[1], 'enq') or now)
      if enq < oldest_enq then oldest_enq = enq end
    end
  end
end
"""

# An end the scripts write themselves: `f` and a `Failed` (fleet.store.events) rendered as a Lua string.
_EVENT = UNMARK + """
local function emit(res, field, value, ttl)
  redis.call('XADD', res, '*', field, value)
  redis.call('EXPIRE', res, ttl)
end
-- A request that ends keeps only what the exactly-once and late-finish rules read (state,
-- outcome, owner, attempt, timing), and its class and chain for an operator: the payload,
-- which can be a whole agent context, and the line bookkeeping go now, not at the TTL. The
-- hash is written afresh rather than trimmed with HDEL: a hash that once held a large field
-- keeps Redis's large encoding (~750 B for these few fields), a new one is packed (~150 B).
-- It also leaves the set of calls its gateway answers for (`fleet.store.callers`).
local KEPT = {'owner', 'attempt', 'priority', 'chain', 'deadline', 'enq', 'claimed', 'streamed', 'preempted'}
local function retire(req, rid, outcome, ttl)
  local f = redis.call('HMGET', req, 'gw', unpack(KEPT))
  local kept = {'state', 'done', 'outcome', outcome}
  for i, name in ipairs(KEPT) do
    if f[i + 1] and f[i + 1] ~= '' then
      kept[#kept + 1] = name
      kept[#kept + 1] = f[i + 1]
    end
  end
  redis.call('DEL', req)
  redis.call('HSET', req, unpack(kept))
  redis.call('EXPIRE', req, ttl)
  unmark(req, rid, f[1])
end
"""

# KEYS: line seq bell counters arrivals req flow_clock flow [admitting] [reader wake]
# ARGV: rid rank payload deadline_rel_ms priority chain ttl_s window_ms admitting_member gateway lease_ms
#       cost half_ms [prefix key]
# (admitting_member '' without the admitting key; gateway '' for no caller's record: `MARK`).
# `cost` '' places the call by arrival (fifo); else by its flow's start tag (`fleet.store.flows`):
# the flow's record becomes start + cost, kept ten half-lives past the call's deadline.
# ARGV[14], optional: the call's prefix key (`fleet.store.affinity`), kept as `aff` (12 and 13: the fair line's).
# ARGV[15], optional: '1' when the last key is a gateway's result-reader wake stream to ring
# (`fleet.store.line_results`): a reader blocked in a read that does not name this call's stream yet
# reads again, with it, in the same step as the call joins, not one round trip of its own later.
# Returns {deadline_ms, now_ms} on the Redis clock.
ENQUEUE = CLOCK + MARK + FLOW_START + """
local seq = redis.call('INCR', KEYS[2])
local rank = tonumber(ARGV[2])
local score
if ARGV[12] and ARGV[12] ~= '' then
  local half = tonumber(ARGV[13])
  local start, v, stored = flow_start(KEYS[1], KEYS[7], KEYS[8], rank, half)
  if v > stored then redis.call('HSET', KEYS[7], rank, n2s(v)) end
  redis.call('SET', KEYS[8], n2s(start + tonumber(ARGV[12])) .. '|' .. n2s(now) .. '|' .. ARGV[1],
    'PX', 10 * half + tonumber(ARGV[4]))
  score = n2s(rank * 1e15 + start)
else
  score = n2s(rank * 1e15 + seq)
end
local deadline = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[6], 'payload', ARGV[3], 'rank', ARGV[2], 'priority', ARGV[5], 'chain', ARGV[6],
  'deadline', n2s(deadline), 'enq', n2s(now), 'score', score, 'state', 'queued', 'attempt', 0, 'owner', '')
if ARGV[14] and ARGV[14] ~= '' then redis.call('HSET', KEYS[6], 'aff', ARGV[14]) end
redis.call('PEXPIRE', KEYS[6], tonumber(ARGV[4]) + tonumber(ARGV[7]) * 1000)
redis.call('ZADD', KEYS[1], score, ARGV[1])
if redis.call('LPUSH', KEYS[3], 1) > 64 then redis.call('LTRIM', KEYS[3], 0, 63) end
redis.call('HINCRBY', KEYS[4], 'accepted', 1)
redis.call('ZADD', KEYS[5], n2s(now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', n2s(now - tonumber(ARGV[8])))
-- The gateway's "being admitted" mark: the line counts the request from now on.
if ARGV[9] ~= '' then redis.call('ZREM', KEYS[9], ARGV[9]) end
if ARGV[15] == '1' then
  redis.call('XADD', KEYS[#KEYS], 'MAXLEN', 1, '*', 'w', '1')
  redis.call('EXPIRE', KEYS[#KEYS], tonumber(ARGV[7]))
end
return {n2s(deadline), n2s(now)}
"""

# KEYS: line inflight counters
# ARGV: n replica lease_ms prefix ttl_s [caps]
# Returns {more, claimed}: claimed is a list of up to n requests, highest class first, each
#   {rid, payload, attempt, remaining_ms, waited_ms, priority, owner, preempted}
# and more is 0 when the claim stopped because the line was empty or a cap was
# reached (claiming again at once would find nothing), else 1.
# `caps` ("c0,c1,c2,c3", `fleet.policy.claim_caps`): at most c<rank> claimed in all
# once a request of that class is reached; the first one over its cap goes back
# with its score and the claim stops (caps never grow with rank).
# where remaining_ms is the time left to its deadline and waited_ms its time in
# the line (both on the Redis clock), and owner "<replica>:<attempt>" is the
# lease this attempt holds. Requests popped but not returned ended on the way:
# their deadline passed in the line (outcome expired, a 504 event for the
# caller), or their hash had expired (counted expired). Pops are bounded, so a
# line full of dead entries cannot stall the script.
# The owner is per attempt: a replica that stalled past its lease and claimed
# the same request again must not renew, stream into or finish the new attempt
# with the old one.
CLAIM = CLOCK + _EVENT + """
local out = {}
local n = tonumber(ARGV[1])
local pops = 0
local more = 1
local caps = nil
if ARGV[6] then
  caps = {}
  for c in string.gmatch(ARGV[6], '[^,]+') do caps[#caps + 1] = tonumber(c) end
end
while #out < n and pops < 4 * n + 16 do
  pops = pops + 1
  local head = redis.call('ZPOPMIN', KEYS[1])
  if #head == 0 then
    more = 0
    break
  end
  local rid = head[1]
  if caps and #out >= caps[math.floor(tonumber(head[2]) / 1e15) + 1] then
    redis.call('ZADD', KEYS[1], head[2], rid)  -- its class has no slot here: back in its place
    more = 0
    break
  end
  local req = ARGV[4] .. 'req:' .. rid
  local f = redis.call('HMGET', req, 'state', 'deadline', 'payload', 'attempt', 'enq', 'priority', 'preempted')
  if not f[1] then
    -- Its hash outlived its deadline by the result TTL: it expired, unseen.
    redis.call('HINCRBY', KEYS[3], 'expired', 1)
  elseif f[1] == 'queued' then
    if tonumber(f[2]) <= now then
      -- A request whose deadline passed in the line never reaches an engine.
      retire(req, rid, 'expired', tonumber(ARGV[5]))
      redis.call('HINCRBY', KEYS[3], 'expired', 1)
      emit(ARGV[4] .. 'res:' .. rid, 'f', """ + lua_literal(EXPIRED_IN_LINE) + """, tonumber(ARGV[5]))
    else
      local attempt = tonumber(f[4]) + 1
      local owner = ARGV[2] .. ':' .. attempt
      redis.call('HSET', req, 'state', 'running', 'owner', owner, 'attempt', attempt, 'claimed', n2s(now),
        'pmark', '')
      redis.call('ZADD', KEYS[2], n2s(now + tonumber(ARGV[3])), rid)
      out[#out + 1] = {rid, f[3], attempt, n2s(tonumber(f[2]) - now), n2s(now - tonumber(f[5])), f[6], owner,
        f[7] or '0'}
    end
  end
end
return {more, out}
"""

# KEYS: inflight req... (one per pair) ; ARGV: lease_ms prefix (rid owner)...
# Returns the rids whose lease the caller no longer holds.
RENEW = CLOCK + """
local lost = {}
for i = 3, #ARGV, 2 do
  local rid = ARGV[i]
  local f = redis.call('HMGET', KEYS[(i - 3) / 2 + 2], 'state', 'owner')
  if f[1] == 'running' and f[2] == ARGV[i + 1] then
    redis.call('ZADD', KEYS[1], 'XX', n2s(now + tonumber(ARGV[1])), rid)
  else
    lost[#lost + 1] = rid
  end
end
return lost
"""

# A chunk's entry (fleet.store.events: field `c`, and `m` the engine's model when given, else ''),
# as EMIT and FINISH (a streamed call's last text) write it.
_CHUNK = """
local function add_chunk(res, body, model)
  if model == '' then
    redis.call('XADD', res, '*', 'c', body)
  else
    redis.call('XADD', res, '*', 'c', body, 'm', model)
  end
end
"""

# KEYS: line inflight counters completions req res
# ARGV: rid outcome owner event ttl_s window_ms prompt_tokens completion_tokens channel event_field
#       last_chunk last_model
# (`event`: the value of the caller's end entry, `event_field` its field; see fleet.store.events;
# `last_chunk`: a streamed call's last text, written just before its end, as EMIT writes a chunk,
# so a worker ends a call in one round trip; '' for none)
# Returns the state it ended the request from ('queued' or 'running'), or '' when
# it had already ended or `owner` no longer holds it (or its hash is gone: a
# `request_lost` event for the caller when a worker finishes it).
FINISH = CLOCK + _EVENT + _CHUNK + """
local f = redis.call('HMGET', KEYS[5], 'state', 'owner')
if not f[1] and ARGV[3] ~= '' then
  -- A worker finished a request whose hash is gone: a failover or a flush lost it under the
  -- worker. Its caller, maybe still waiting, hears so now rather than at its deadline.
  emit(KEYS[6], 'f', """ + lua_literal(REQUEST_LOST) + """, tonumber(ARGV[5]))
  return ''
end
if not f[1] or f[1] == 'done' then return '' end
if ARGV[3] ~= '' and f[2] ~= ARGV[3] then return '' end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
retire(KEYS[5], ARGV[1], ARGV[2], tonumber(ARGV[5]))
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
if ARGV[2] == 'completed' then
  redis.call('ZADD', KEYS[4], n2s(now), ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', n2s(now - tonumber(ARGV[6])))
  redis.call('HINCRBY', KEYS[3], 'prompt_tokens', tonumber(ARGV[7]))
  redis.call('HINCRBY', KEYS[3], 'completion_tokens', tonumber(ARGV[8]))
end
if ARGV[11] ~= '' then add_chunk(KEYS[6], ARGV[11], ARGV[12]) end
if ARGV[4] ~= '' then emit(KEYS[6], ARGV[10], ARGV[4], tonumber(ARGV[5])) end
if f[1] == 'running' and ARGV[3] == '' then
  -- Someone other than the owner ended it (cancel, deadline): abort it in the engine.
  redis.call('PUBLISH', ARGV[9], ARGV[1])
end
return f[1]
"""

# KEYS: inflight (req res)... (one pair per entry)
# ARGV: prefix ttl_s (rid owner first chunk model)...
# Chunks (fleet.store.events: field `c`, and `m` the engine's model when given) are written
# only while their writer still holds the lease, so a replica whose lease was reaped cannot
# interleave its text with the next attempt's. Returns the positions of the entries whose
# lease is gone.
EMIT = SHEBANG + _CHUNK + """
local lost = {}
for i = 3, #ARGV, 5 do
  local at = (i - 3) / 5 * 2 + 2
  local req = KEYS[at]
  local f = redis.call('HMGET', req, 'state', 'owner')
  if f[1] == 'running' and f[2] == ARGV[i + 1] then
    if ARGV[i + 2] == '1' then redis.call('HSET', req, 'streamed', '1') end
    local res = KEYS[at + 1]
    add_chunk(res, ARGV[i + 3], ARGV[i + 4])
    redis.call('EXPIRE', res, tonumber(ARGV[2]))
  else
    lost[#lost + 1] = (i - 3) / 5
  end
end
return lost
"""

# KEYS: inflight line counters bell dead ; ARGV: prefix max_attempts ttl_s
# Returns {requeued, lost, expired}. An in-flight entry whose request hash is
# gone (its TTL ran out: the gateway and the worker both vanished long ago) is
# counted `expired`, as CLAIM counts the same case, so that accepted =
# completed + expired + cancelled + failed holds whatever vanishes.
REAP = CLOCK + _EVENT + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', n2s(now), 'LIMIT', 0, 200)
local requeued, lost, vanished = 0, 0, 0
for _, rid in ipairs(expired) do
  redis.call('ZREM', KEYS[1], rid)
  local req = ARGV[1] .. 'req:' .. rid
  local f = redis.call('HMGET', req, 'state', 'streamed', 'attempt', 'score')
  if not f[1] then
    redis.call('HINCRBY', KEYS[3], 'expired', 1)
    vanished = vanished + 1
  elseif f[1] == 'running' then
    local res = ARGV[1] .. 'res:' .. rid
    if f[2] == '1' then
      -- Tokens already reached the caller: a rerun would duplicate them.
      retire(req, rid, 'failed', tonumber(ARGV[3]))
      redis.call('HINCRBY', KEYS[3], 'failed', 1)
      emit(res, 'f', """ + lua_literal(WORKER_LOST) + """, tonumber(ARGV[3]))
      lost = lost + 1
    elseif tonumber(f[3]) >= tonumber(ARGV[2]) then
      retire(req, rid, 'failed', tonumber(ARGV[3]))
      redis.call('HINCRBY', KEYS[3], 'failed', 1)
      redis.call('LPUSH', KEYS[5], rid)
      redis.call('LTRIM', KEYS[5], 0, 999)
      emit(res, 'f', """ + lua_literal(SET_ASIDE) + """, tonumber(ARGV[3]))
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
return {requeued, lost, vanished}
"""

# KEYS: line inflight counters arrivals completions ; ARGV: window_ms prefix
# Returns {now_ms, waiting by class (4), oldest wait ms, in flight, arrivals in
# the window, completions in the window, the counters hash flattened}.
OBSERVE = CLOCK + LUA_BY_CLASS + """
local oldest = now - oldest_enq
local since = n2s(now - tonumber(ARGV[1]))
return {n2s(now), by_class, n2s(oldest), redis.call('ZCARD', KEYS[2]),
  redis.call('ZCOUNT', KEYS[4], since, '+inf'), redis.call('ZCOUNT', KEYS[5], since, '+inf'),
  redis.call('HGETALL', KEYS[3])}
"""

# KEYS: line ; ARGV: prefix scan below_rank stale_ms
# The highest-class waiting request of a class above `below_rank` that no
# replica has preempted for yet, among the first `scan` of those: {rid, rank,
# waited_ms}, or {}. A mark older than `stale_ms` does not count: the replica
# that made room for the request never claimed anything (it died).
PEEK = CLOCK + """
local head = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. n2s(tonumber(ARGV[3]) * 1e15), 'LIMIT', 0,
  tonumber(ARGV[2]))
for _, rid in ipairs(head) do
  local f = redis.call('HMGET', ARGV[1] .. 'req:' .. rid, 'state', 'pmark', 'rank', 'enq')
  if f[1] == 'queued' and (not f[2] or f[2] == '' or tonumber(f[2]) < now - tonumber(ARGV[4])) then
    return {rid, tonumber(f[3]), n2s(now - tonumber(f[4]))}
  end
end
return {}
"""

# KEYS: line inflight counters bell
# ARGV: prefix waiter victim victim_owner max_preemptions stale_ms
# Preempt `victim` (running under `victim_owner`) for `waiter`, atomically and
# once per waiting call: the waiter is still queued, of a higher class, and no
# replica has preempted for it within `stale_ms` (it gets `pmark`, the time);
# the victim is still held by that owner, has streamed nothing and was
# preempted fewer than max_preemptions times. The victim goes back to the line
# with its own score (the head of its class, in arrival order) and its lease
# ends, so the old attempt can no longer stream into it or finish it. Returns
# 1 if done, else 0.
PREEMPT = CLOCK + """
local w = ARGV[1] .. 'req:' .. ARGV[2]
local wf = redis.call('HMGET', w, 'state', 'pmark', 'rank')
if wf[1] ~= 'queued' then return 0 end
if wf[2] and wf[2] ~= '' and tonumber(wf[2]) >= now - tonumber(ARGV[6]) then return 0 end
local v = ARGV[1] .. 'req:' .. ARGV[3]
local vf = redis.call('HMGET', v, 'state', 'owner', 'streamed', 'preempted', 'score', 'priority', 'rank')
if vf[1] ~= 'running' or vf[2] ~= ARGV[4] or vf[3] == '1' then return 0 end
if tonumber(vf[7]) <= tonumber(wf[3]) then return 0 end
local n = tonumber(vf[4] or '0')
if n >= tonumber(ARGV[5]) then return 0 end
redis.call('HSET', w, 'pmark', n2s(now))
redis.call('HSET', v, 'state', 'queued', 'owner', '', 'preempted', n + 1)
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[1], vf[5], ARGV[3])
redis.call('HINCRBY', KEYS[3], 'preempted', 1)
redis.call('HINCRBY', KEYS[3], 'preempted:' .. vf[6], 1)
redis.call('LPUSH', KEYS[4], 1)
redis.call('LTRIM', KEYS[4], 0, 63)
return 1
"""

# KEYS: req... ; returns the positions (from 0) of the requests whose hash is gone: the
# gateway asks for the calls it still waits on, whose request a failover or a flush took.
MISSING = SHEBANG + """
local gone = {}
for i, k in ipairs(KEYS) do
  if redis.call('EXISTS', k) == 0 then gone[#gone + 1] = i - 1 end
end
return gone
"""

# Renew this gateway's caller lease; end the calls of gateways gone (`fleet.store.callers`).
SWEEP = CLOCK + _EVENT + SWEEP_BODY
