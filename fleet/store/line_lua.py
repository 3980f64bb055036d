"""What the line's scripts share: the constants rendered into them, and their Lua functions.

Each fragment here is Lua defining local functions, given what they need as parameters; a
`fleet.store.lua.Script` lists the ones it uses (`uses=`), after the ones they call. They may
call the key helpers (`request_key(rid)` ...: a script using them declares `prefix`), `now`
and `n2s` (the clock) and the constants of `LINE_CONSTS`.

Users: `fleet.store.line_scripts` (the line's own scripts), `fleet.store.affinity` (the affine
claim), `fleet.store.callers` (the sweep of gateways gone), `fleet.store.admitting` (the view
by class), `fleet.store.flows` (the class span).
"""

from __future__ import annotations

from fleet.outcome import LINE_OUTCOMES
from fleet.store.events import CHUNK, EXPIRED_IN_LINE, FAILED, MODEL, REQUEST_LOST, SET_ASIDE, WORKER_LOST, encode

CLASS_SPAN = 10**15  # arrival sequences stay below this; ranks * span stay exact in a double
# The line's words, from the one outcome type (`unavailable`: the gateway told the caller 503
# because Redis was away, and ended the call once Redis answered again).
OUTCOMES: tuple[str, ...] = tuple(str(o) for o in LINE_OUTCOMES)

# Rendered into a line script where its text names them (`Script(consts=...)`).
LINE_CONSTS: dict[str, int | str] = {
    "CLASS_SPAN": CLASS_SPAN,
    **{f"OUTCOME_{o.upper()}": o for o in OUTCOMES},
    "FIELD_CHUNK": CHUNK.decode(),
    "FIELD_MODEL": MODEL.decode(),
    "FIELD_FAILED": FAILED.decode(),
    # The ends the scripts decide themselves, as `fleet.store.events` encodes them.
    "EXPIRED_IN_LINE": encode(EXPIRED_IN_LINE)[1].decode(),
    "WORKER_LOST": encode(WORKER_LOST)[1].decode(),
    "SET_ASIDE": encode(SET_ASIDE)[1].decode(),
    "REQUEST_LOST": encode(REQUEST_LOST)[1].decode(),
}

# `by_class(line)`: {requests waiting per class, highest first}, and when the longest waiter
# joined (or now). An empty line (the common case when idle) costs one call. Shared by
# OBSERVE and the gateway's admission view (`fleet.store.admitting`).
BY_CLASS = """
local function by_class_of(line)
  local by_class, oldest_enq = {0, 0, 0, 0}, now
  if redis.call('ZCARD', line) > 0 then
    for rank = 0, 3 do
      local lo, hi = n2s(rank * CLASS_SPAN), '(' .. n2s((rank + 1) * CLASS_SPAN)
      by_class[rank + 1] = redis.call('ZCOUNT', line, lo, hi)
      if by_class[rank + 1] > 0 then
        local head = redis.call('ZRANGEBYSCORE', line, lo, hi, 'LIMIT', 0, 1)
        local enq = tonumber(redis.call('HGET', request_key(head[1]), 'enq') or now)
        if enq < oldest_enq then oldest_enq = enq end
      end
    end
  end
  return by_class, oldest_enq
end
"""

# An end the scripts write themselves (`emit`), and `retire`: a request that ends keeps only
# what the exactly-once and late-finish rules read (state, outcome, owner, attempt, timing), and
# its class, chain and deadline's source for an operator: the payload, which can be a whole agent context, and the
# line bookkeeping go now, not at the TTL. The hash is written afresh rather than trimmed with
# HDEL: a hash that once held a large field keeps Redis's large encoding (~750 B for these few
# fields), a new one is packed (~150 B). It also leaves the set of calls its gateway answers for
# (`fleet.store.callers`).
RETIRE = """
local function emit(res, field, value, ttl)
  redis.call('XADD', res, '*', field, value)
  redis.call('EXPIRE', res, ttl)
end
local KEPT = {'owner', 'attempt', 'priority', 'chain', 'deadline', 'enq', 'claimed', 'streamed', 'preempted',
  'deadline_source'}
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
  if f[1] then redis.call('ZREM', calls_key(f[1]), rid) end
end
"""

# A chunk's entry (fleet.store.events: field `c`, and `m` the engine's model when given, else ''),
# as EMIT and FINISH (a streamed call's last text) write it.
ADD_CHUNK = """
local function add_chunk(res, body, model)
  if model == '' then
    redis.call('XADD', res, '*', FIELD_CHUNK, body)
  else
    redis.call('XADD', res, '*', FIELD_CHUNK, body, FIELD_MODEL, model)
  end
end
"""

# Taking calls, for CLAIM and AFFINE_CLAIM alike. `parse_caps(caps)`: "c0,c1,c2,c3"
# (`fleet.policy.claim_caps`) as a table, or nil for ''. `take(rid, ...)`: the call `rid`, just
# out of the line, for `replica` under a lease of `lease_ms`: returns its claimed row
# {rid, payload, attempt, remaining_ms, waited_ms, priority, owner, preempted} and its prefix
# key (`aff`), or nil when it ended on the way: its deadline passed in the line (outcome
# expired, a 504 event for the caller), or its hash had expired (counted expired). The owner
# is per attempt: a replica that stalled past its lease and claimed the same request again
# must not renew, stream into or finish the new attempt with the old one.
TAKE = """
local function parse_caps(caps)
  if caps == '' then return nil end
  local out = {}
  for c in string.gmatch(caps, '[^,]+') do out[#out + 1] = tonumber(c) end
  return out
end
local function take(rid, replica, lease_ms, ttl, inflight, counters)
  local req = request_key(rid)
  local f = redis.call('HMGET', req, 'state', 'deadline', 'payload', 'attempt', 'enq', 'priority', 'preempted', 'aff')
  if not f[1] then
    -- Its hash outlived its deadline by the result TTL: it expired, unseen.
    redis.call('HINCRBY', counters, OUTCOME_EXPIRED, 1)
  elseif f[1] == 'queued' then
    if tonumber(f[2]) <= now then
      -- A request whose deadline passed in the line never reaches an engine.
      retire(req, rid, OUTCOME_EXPIRED, ttl)
      redis.call('HINCRBY', counters, OUTCOME_EXPIRED, 1)
      emit(result_key(rid), FIELD_FAILED, EXPIRED_IN_LINE, ttl)
    else
      local attempt = tonumber(f[4]) + 1
      local owner = replica .. ':' .. attempt
      redis.call('HSET', req, 'state', 'running', 'owner', owner, 'attempt', attempt, 'claimed', n2s(now),
        'pmark', '')
      redis.call('ZADD', inflight, n2s(now + lease_ms), rid)
      return {rid, f[3], attempt, n2s(tonumber(f[2]) - now), n2s(now - tonumber(f[5])), f[6], owner,
        f[7] or '0'}, f[8]
    end
  end
  return nil, nil
end
"""
