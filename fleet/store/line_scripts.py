"""The line's Lua scripts: each mutation of a tier's line is one atomic script.

`fleet.store.line.Line` is their only caller; the layout they share is in its module doc.
Each is a `fleet.store.lua.Script`: its keys and arguments are named (the Lua binds them in its
first lines, Python passes them by keyword), the constants come from `fleet.store.line_lua`
(`LINE_CONSTS`), and so do the Lua functions they share. `now` is the Redis server's time in ms.
"""

from __future__ import annotations

from fleet.store.callers import MARK
from fleet.store.flows import FLOW_START
from fleet.store.line_lua import ADD_CHUNK, BY_CLASS, CLASS_SPAN, LINE_CONSTS, OUTCOMES, RETIRE, TAKE
from fleet.store.lua import Script

__all__ = ["CLAIM", "CLASS_SPAN", "EMIT", "ENQUEUE", "FINISH", "MISSING", "OBSERVE", "OUTCOMES", "PEEK",
           "PREEMPT", "REAP", "RENEW"]

# Join the line. `deadline_ms`: relative; `admitting_member` '' for no admission mark to drop
# (`fleet.store.admitting`); `gateway` '' for no caller's record (`fleet.store.callers`).
# `cost` '' places the call by arrival (fifo); else by its flow's start tag (`fleet.store.flows`):
# the flow's record becomes start + cost, kept ten half-lives past the call's deadline.
# `affinity`: the call's prefix key (`fleet.store.affinity`), kept as `aff` ('' for none).
# `deadline_source`: where its deadline came from (header, client, default), kept as such ('' for none).
# `reader_wake`, optional: a gateway's result-reader wake stream to ring (`fleet.store.line_results`):
# a reader blocked in a read that does not name this call's stream yet reads again, with it, in
# the same step as the call joins, not one round trip of its own later.
# Returns {deadline_ms, now_ms} on the Redis clock.
ENQUEUE = Script(
    "ENQUEUE",
    keys=("line", "seq", "bell", "counters", "arrivals", "req", "flow_clock", "flow", "admitting", "callers"),
    optional_keys=("reader_wake",),
    args=("prefix", "rid", "rank", "payload", "deadline_ms", "priority", "chain", "ttl_s", "window_ms",
          "admitting_member", "gateway", "lease_ms", "cost", "half_ms", "affinity", "deadline_source"),
    consts=LINE_CONSTS, uses=(MARK, FLOW_START), body="""
local rel = tonumber(deadline_ms)
if gateway ~= '' then
  mark_caller(callers, req, rid, gateway, now + rel, rel + tonumber(ttl_s) * 1000, tonumber(lease_ms))
end
local arrival = redis.call('INCR', seq)
local class = tonumber(rank)
local score
if cost ~= '' then
  local half = tonumber(half_ms)
  local start, v, stored = flow_start(line, flow_clock, flow, class, half)
  if v > stored then redis.call('HSET', flow_clock, class, n2s(v)) end
  redis.call('SET', flow, n2s(start + tonumber(cost)) .. '|' .. n2s(now) .. '|' .. rid, 'PX', 10 * half + rel)
  score = n2s(class * CLASS_SPAN + start)
else
  score = n2s(class * CLASS_SPAN + arrival)
end
local deadline = now + rel
redis.call('HSET', req, 'payload', payload, 'rank', rank, 'priority', priority, 'chain', chain,
  'deadline', n2s(deadline), 'enq', n2s(now), 'score', score, 'state', 'queued', 'attempt', 0, 'owner', '')
if affinity ~= '' then redis.call('HSET', req, 'aff', affinity) end
if deadline_source ~= '' then redis.call('HSET', req, 'deadline_source', deadline_source) end
redis.call('PEXPIRE', req, rel + tonumber(ttl_s) * 1000)
redis.call('ZADD', line, score, rid)
if redis.call('LPUSH', bell, 1) > 64 then redis.call('LTRIM', bell, 0, 63) end
redis.call('HINCRBY', counters, 'accepted', 1)
redis.call('ZADD', arrivals, n2s(now), rid)
redis.call('ZREMRANGEBYSCORE', arrivals, '-inf', n2s(now - tonumber(window_ms)))
-- The gateway's "being admitted" mark: the line counts the request from now on.
if admitting_member ~= '' then redis.call('ZREM', admitting, admitting_member) end
if reader_wake then
  redis.call('XADD', reader_wake, 'MAXLEN', 1, '*', 'w', '1')
  redis.call('EXPIRE', reader_wake, tonumber(ttl_s))
end
return {n2s(deadline), n2s(now)}
""")

# Take up to `n` calls for `replica` under a lease of `lease_ms`, highest class first (`take`
# in `fleet.store.line_lua`). Returns {more, claimed}: claimed is a list of rows as `take`
# returns them; more is 0 when the claim stopped because the line was empty or a cap was
# reached (claiming again at once would find nothing), else 1.
# `caps` ("c0,c1,c2,c3", `fleet.policy.claim_caps`; '' for none): at most c<rank> claimed in all
# once a request of that class is reached; the first one over its cap goes back with its score
# and the claim stops (caps never grow with rank). Pops are bounded, so a line full of dead
# entries cannot stall the script.
CLAIM = Script(
    "CLAIM", keys=("line", "inflight", "counters"), args=("n", "replica", "lease_ms", "prefix", "ttl_s", "caps"),
    consts=LINE_CONSTS, uses=(RETIRE, TAKE), body="""
local out, more, pops = {}, 1, 0
local want, lease, ttl, cap = tonumber(n), tonumber(lease_ms), tonumber(ttl_s), parse_caps(caps)
while #out < want and pops < 4 * want + 16 do
  pops = pops + 1
  local head = redis.call('ZPOPMIN', line)
  if #head == 0 then
    more = 0
    break
  end
  local rid = head[1]
  if cap and #out >= cap[math.floor(tonumber(head[2]) / CLASS_SPAN) + 1] then
    redis.call('ZADD', line, head[2], rid)  -- its class has no slot here: back in its place
    more = 0
    break
  end
  local row = take(rid, replica, lease, ttl, inflight, counters)
  if row then out[#out + 1] = row end
end
return {more, out}
""")

# Extend the leases of `held` ({req, rid, owner} each). Returns the rids whose lease the caller no longer holds.
RENEW = Script(
    "RENEW", keys=("inflight",), args=("lease_ms",), rows=("held", ("req",), ("rid", "owner")), body="""
local lost, lease = {}, tonumber(lease_ms)
for _, h in ipairs(held) do
  local f = redis.call('HMGET', h.req, 'state', 'owner')
  if f[1] == 'running' and f[2] == h.owner then
    redis.call('ZADD', inflight, 'XX', n2s(now + lease), h.rid)
  else
    lost[#lost + 1] = h.rid
  end
end
return lost
""")

# End a call with one outcome. `event`: the value of the caller's end entry, `event_field` its
# field ('' for none; see fleet.store.events); `last_chunk`: a streamed call's last text, written
# just before its end, as EMIT writes a chunk, so a worker ends a call in one round trip ('' for none).
# Returns the state it ended the request from ('queued' or 'running'), or '' when it had already
# ended or `owner` no longer holds it (or its hash is gone: a `request_lost` event for the caller
# when a worker finishes it).
FINISH = Script(
    "FINISH", keys=("line", "inflight", "counters", "completions", "req", "res"),
    args=("prefix", "rid", "outcome", "owner", "event", "ttl_s", "window_ms", "prompt_tokens",
          "completion_tokens", "channel", "event_field", "last_chunk", "last_model"),
    consts=LINE_CONSTS, uses=(RETIRE, ADD_CHUNK), body="""
local ttl = tonumber(ttl_s)
local f = redis.call('HMGET', req, 'state', 'owner')
if not f[1] and owner ~= '' then
  -- A worker finished a request whose hash is gone: a failover or a flush lost it under the
  -- worker. Its caller, maybe still waiting, hears so now rather than at its deadline.
  emit(res, FIELD_FAILED, REQUEST_LOST, ttl)
  return ''
end
if not f[1] or f[1] == 'done' then return '' end
if owner ~= '' and f[2] ~= owner then return '' end
redis.call('ZREM', line, rid)
redis.call('ZREM', inflight, rid)
retire(req, rid, outcome, ttl)
redis.call('HINCRBY', counters, outcome, 1)
if outcome == OUTCOME_COMPLETED then
  redis.call('ZADD', completions, n2s(now), rid)
  redis.call('ZREMRANGEBYSCORE', completions, '-inf', n2s(now - tonumber(window_ms)))
  redis.call('HINCRBY', counters, 'prompt_tokens', tonumber(prompt_tokens))
  redis.call('HINCRBY', counters, 'completion_tokens', tonumber(completion_tokens))
end
if last_chunk ~= '' then add_chunk(res, last_chunk, last_model) end
if event ~= '' then emit(res, event_field, event, ttl) end
if f[1] == 'running' and owner == '' then
  -- Someone other than the owner ended it (cancel, deadline): abort it in the engine.
  redis.call('PUBLISH', channel, rid)
end
return f[1]
""")

# Append `chunks` ({req, res, rid, owner, first, body, model} each) to their result streams.
# Chunks (fleet.store.events: field `c`, and `m` the engine's model when given) are written
# only while their writer still holds the lease, so a replica whose lease was reaped cannot
# interleave its text with the next attempt's. Returns the positions (from 0) of the entries
# whose lease is gone.
EMIT = Script(
    "EMIT", keys=("inflight",), args=("ttl_s",),
    rows=("chunks", ("req", "res"), ("rid", "owner", "first", "body", "model")),
    clock=False, consts=LINE_CONSTS, uses=(ADD_CHUNK,), body="""
local lost, ttl = {}, tonumber(ttl_s)
for i, c in ipairs(chunks) do
  local f = redis.call('HMGET', c.req, 'state', 'owner')
  if f[1] == 'running' and f[2] == c.owner then
    if c.first == '1' then redis.call('HSET', c.req, 'streamed', '1') end
    add_chunk(c.res, c.body, c.model)
    redis.call('EXPIRE', c.res, ttl)
  else
    lost[#lost + 1] = i - 1
  end
end
return lost
""")

# Requeue what ran past its lease. Returns {requeued, lost, expired}. An in-flight entry whose
# request hash is gone (its TTL ran out: the gateway and the worker both vanished long ago) is
# counted `expired`, as CLAIM counts the same case, so that accepted = completed + expired +
# cancelled + failed holds whatever vanishes.
REAP = Script(
    "REAP", keys=("inflight", "line", "counters", "bell", "dead"), args=("prefix", "max_attempts", "ttl_s"),
    consts=LINE_CONSTS, uses=(RETIRE,), body="""
local ttl = tonumber(ttl_s)
local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', n2s(now), 'LIMIT', 0, 200)
local requeued, lost, vanished = 0, 0, 0
for _, rid in ipairs(expired) do
  redis.call('ZREM', inflight, rid)
  local req = request_key(rid)
  local f = redis.call('HMGET', req, 'state', 'streamed', 'attempt', 'score')
  if not f[1] then
    redis.call('HINCRBY', counters, OUTCOME_EXPIRED, 1)
    vanished = vanished + 1
  elseif f[1] == 'running' then
    if f[2] == '1' then
      -- Tokens already reached the caller: a rerun would duplicate them.
      retire(req, rid, OUTCOME_FAILED, ttl)
      redis.call('HINCRBY', counters, OUTCOME_FAILED, 1)
      emit(result_key(rid), FIELD_FAILED, WORKER_LOST, ttl)
      lost = lost + 1
    elseif tonumber(f[3]) >= tonumber(max_attempts) then
      retire(req, rid, OUTCOME_FAILED, ttl)
      redis.call('HINCRBY', counters, OUTCOME_FAILED, 1)
      redis.call('LPUSH', dead, rid)
      redis.call('LTRIM', dead, 0, 999)
      emit(result_key(rid), FIELD_FAILED, SET_ASIDE, ttl)
      lost = lost + 1
    else
      redis.call('HSET', req, 'state', 'queued', 'owner', '')
      redis.call('ZADD', line, f[4], rid)
      redis.call('LPUSH', bell, 1)
      redis.call('HINCRBY', counters, 'requeued', 1)
      requeued = requeued + 1
    end
  end
end
return {requeued, lost, vanished}
""")

# Returns {now_ms, waiting by class (4), oldest wait ms, in flight, arrivals in the window,
# completions in the window, the counters hash flattened}.
OBSERVE = Script(
    "OBSERVE", keys=("line", "inflight", "counters", "arrivals", "completions"), args=("window_ms", "prefix"),
    consts=LINE_CONSTS, uses=(BY_CLASS,), body="""
local by_class, oldest_enq = by_class_of(line)
local since = n2s(now - tonumber(window_ms))
return {n2s(now), by_class, n2s(now - oldest_enq), redis.call('ZCARD', inflight),
  redis.call('ZCOUNT', arrivals, since, '+inf'), redis.call('ZCOUNT', completions, since, '+inf'),
  redis.call('HGETALL', counters)}
""")

# The highest-class waiting request of a class above `below_rank` that no replica has preempted
# for yet, among the first `scan` of those: {rid, rank, waited_ms}, or {}. A mark older than
# `stale_ms` does not count: the replica that made room for the request never claimed anything (it died).
PEEK = Script(
    "PEEK", keys=("line",), args=("prefix", "scan", "below_rank", "stale_ms"), consts=LINE_CONSTS, body="""
local head = redis.call('ZRANGEBYSCORE', line, '-inf', '(' .. n2s(tonumber(below_rank) * CLASS_SPAN), 'LIMIT', 0,
  tonumber(scan))
for _, rid in ipairs(head) do
  local f = redis.call('HMGET', request_key(rid), 'state', 'pmark', 'rank', 'enq')
  if f[1] == 'queued' and (not f[2] or f[2] == '' or tonumber(f[2]) < now - tonumber(stale_ms)) then
    return {rid, tonumber(f[3]), n2s(now - tonumber(f[4]))}
  end
end
return {}
""")

# Preempt `victim` (running under `victim_owner`) for `waiter`, atomically and once per waiting
# call: the waiter is still queued, of a higher class, and no replica has preempted for it within
# `stale_ms` (it gets `pmark`, the time); the victim is still held by that owner, has streamed
# nothing and was preempted fewer than max_preemptions times. The victim goes back to the line
# with its own score (the head of its class, in arrival order) and its lease ends, so the old
# attempt can no longer stream into it or finish it. Returns 1 if done, else 0.
PREEMPT = Script(
    "PREEMPT", keys=("line", "inflight", "counters", "bell"),
    args=("prefix", "waiter", "victim", "victim_owner", "max_preemptions", "stale_ms"), body="""
local w = request_key(waiter)
local wf = redis.call('HMGET', w, 'state', 'pmark', 'rank')
if wf[1] ~= 'queued' then return 0 end
if wf[2] and wf[2] ~= '' and tonumber(wf[2]) >= now - tonumber(stale_ms) then return 0 end
local v = request_key(victim)
local vf = redis.call('HMGET', v, 'state', 'owner', 'streamed', 'preempted', 'score', 'priority', 'rank')
if vf[1] ~= 'running' or vf[2] ~= victim_owner or vf[3] == '1' then return 0 end
if tonumber(vf[7]) <= tonumber(wf[3]) then return 0 end
local times = tonumber(vf[4] or '0')
if times >= tonumber(max_preemptions) then return 0 end
redis.call('HSET', w, 'pmark', n2s(now))
redis.call('HSET', v, 'state', 'queued', 'owner', '', 'preempted', times + 1)
redis.call('ZREM', inflight, victim)
redis.call('ZADD', line, vf[5], victim)
redis.call('HINCRBY', counters, 'preempted', 1)
redis.call('HINCRBY', counters, 'preempted:' .. vf[6], 1)
redis.call('LPUSH', bell, 1)
redis.call('LTRIM', bell, 0, 63)
return 1
""")

# The positions (from 0) of the `reqs` ({req} each) whose hash is gone: the gateway asks for the
# calls it still waits on, whose request a failover or a flush took.
MISSING = Script("MISSING", rows=("reqs", ("req",), ()), clock=False, body="""
local gone = {}
for i, r in ipairs(reqs) do
  if redis.call('EXISTS', r.req) == 0 then gone[#gone + 1] = i - 1 end
end
return gone
""")
