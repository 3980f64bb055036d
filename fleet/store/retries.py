"""Retries joined to the call still running, and the tier's retry budget: `TierKeys.retry`, `TierKeys.retry_window`.

Two key families of a tier, both under its hash tag:

- `retry:<identity>` STRING "state|request id|body digest|tier|reason", state `parked` or `taken`:
  a call whose client left while its SDK will still retry it, kept for `client_clock.retry_grace_s`
  (the key's TTL) for a retry of the same identity to take over (`taken`, with the TTL of that
  retry's deadline). `tier` is where the call waits or runs when that is not the tier the record
  is kept under (a degraded call is parked under the tier it asked for, which its retry asks
  again: `gateway.degrade`), and the reason it was degraded; '' otherwise. A key gone means
  nobody took it in time: the call's owner ends it. State `refused`: the fleet refused the
  attempt and said when to come back; the retry it invited is not charged to the retry budget.
- `retry-window` HASH `f<second>` / `r<second>`: first attempts and retries that joined nothing,
  per second, over the budget window.

Writers: a call's owner parks it (`Retries.park`); the admission script (`RETRY_GATE`, run at
the head of `fleet.store.admitting.OBSERVE_AND_MARK`) takes it over or spends the budget; the
owner reads the record (`Retries.state`) to know whether anyone took it. The budget rule is
`fleet.policy.retries.retry_allowed`, held to this Lua by tests/store/test_retries.py.
"""

from __future__ import annotations

from redis.asyncio import Redis

from fleet.store.keys import TierKeys

# The gate's answers, in place of the admission snapshot (its first element; a snapshot's is
# the Redis clock in ms, never negative).
JOINED, RETRY_BUDGET_SPENT, OTHER_BODY = -1, -2, -3

# Rendered into the script that runs the gate (`fleet.store.lua.Script(consts=...)`).
GATE_CONSTS: dict[str, int | str] = {"JOINED": JOINED, "RETRY_BUDGET_SPENT": RETRY_BUDGET_SPENT,
                                     "OTHER_BODY": OTHER_BODY}

# A Lua function (needs the clock and `GATE_CONSTS`): `retry_gate(retry_key, window_key, digest,
# attempt, taken_ms, ratio, budget_s, min_per_s)` returns the gate's answer ({JOINED, rid, tier, reason},
# {RETRY_BUDGET_SPENT} or {OTHER_BODY}), or nil when the attempt goes on to admission.
# `digest` '' for an attempt that joins nothing; `attempt` 'retry' or 'first'.
RETRY_GATE = """
local function retry_gate(retry_key, window_key, digest, attempt, taken_ms, ratio, budget_s, min_per_s)
  if digest ~= '' then
    local rec = redis.call('GET', retry_key)
    if rec then
      local f = {}
      for part in string.gmatch(rec .. '|', '([^|]*)|') do f[#f + 1] = part end
      local state, rid, d, tier, why = f[1], f[2], f[3] or '', f[4] or '', f[5] or ''
      if state == 'parked' then
        if d ~= digest then return {OTHER_BODY} end
        redis.call('SET', retry_key, table.concat({'taken', rid, d, tier, why}, '|'), 'PX', taken_ms)
        return {JOINED, rid, tier, why}
      end
      if state == 'refused' then
        -- The fleet refused its last attempt and told it when to come back: a retry it asked
        -- for runs nothing twice, so it is no retry for the budget.
        redis.call('DEL', retry_key)
        attempt = 'invited'
      end
    end
  end
  local sec = math.floor(now / 1000)
  if attempt == 'retry' then
    local fields = {}
    for i = 0, budget_s - 1 do
      fields[#fields + 1] = 'f' .. (sec - i)
      fields[#fields + 1] = 'r' .. (sec - i)
    end
    local got = redis.call('HMGET', window_key, unpack(fields))
    local firsts, retries = 0, 0
    for i = 1, #got, 2 do
      firsts = firsts + tonumber(got[i] or 0)
      retries = retries + tonumber(got[i + 1] or 0)
    end
    if retries + 1 > math.max(ratio * firsts, min_per_s * budget_s) then return {RETRY_BUDGET_SPENT} end
  end
  if attempt == 'invited' then return nil end
  local field = (attempt == 'retry' and 'r' or 'f') .. sec
  -- The seconds that left the window are dropped by the first attempt of each new second (and
  -- the key's TTL renewed then): once a second, not on every call of the hot path.
  if redis.call('HINCRBY', window_key, field, 1) == 1 then
    local old = {}
    for i = budget_s, 2 * budget_s do
      old[#old + 1] = 'f' .. (sec - i)
      old[#old + 1] = 'r' .. (sec - i)
    end
    redis.call('HDEL', window_key, unpack(old))
    redis.call('EXPIRE', window_key, budget_s + 1)
  end
  return nil
end
"""


class Retries:
    """One namespace's parked calls (the records the admission script takes over)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def park(self, keys: TierKeys, identity: str, rid: str, digest: str, grace_ms: int,
                   runs_in: str = "", why: str = "") -> None:
        """The call's client left: keep it `grace_ms` for a retry of `identity` to take over.
        `runs_in`: the tier whose line holds it, when that is not the tier of `keys` (degraded,
        for `why`)."""
        await self.redis.set(keys.retry(identity), f"parked|{rid}|{digest}|{runs_in}|{why}", px=max(1, grace_ms))

    async def refused(self, keys: TierKeys, identity: str, digest: str, ttl_ms: int) -> None:
        """The attempt was refused with a Retry-After: its retry, if it comes within `ttl_ms`, was
        invited, and spends no retry budget."""
        await self.redis.set(keys.retry(identity), f"refused|-|{digest}", px=max(1, ttl_ms), nx=True)

    async def state(self, keys: TierKeys, identity: str, rid: str) -> str | None:
        """`parked` or `taken` while the record still names `rid`; None once it is gone (or names
        another call): nobody took it within its grace."""
        raw = await self.redis.get(keys.retry(identity))
        if raw is None:
            return None
        state, _, rest = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition("|")
        return state if rest.partition("|")[0] == rid else None
