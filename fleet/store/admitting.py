"""What admission sees of a tier in one round trip, and the "being admitted" marks: `TierKeys.admitting`.

The gateway's admission reads the line by class, the completions, the busy
spell and the budget judgement, and marks its request as being admitted, in
ONE Lua call, so a burst of concurrent calls sees each other instead of all
reading the same empty line. The mark (`"<rank>:<request id>"`, scored by
its expiry on the Redis clock) is dropped by ENQUEUE when the request joins
the line, by `unmark` when it is refused, and by its expiry if its gateway
dies in between. Writer and reader of the marks: the gateways' admission.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.store.flows import FLOW_START, Place
from fleet.store.keys import TierKeys
from fleet.store.line_lua import BY_CLASS, LINE_CONSTS
from fleet.store.lua import Script, named
from fleet.store.retries import GATE_CONSTS, JOINED, RETRY_GATE
from fleet.store.tier_budget import EXHAUSTED, RETRY_AT

# How long a "being admitted" mark lives if its gateway dies between the decision and the line.
ADMITTING_HOLD_MS = 5000

# `member`: this call's mark, held `hold_ms`. The retry gate's arguments (`digest` .. `min_per_s`,
# `fleet.store.retries`): a retry takes over the call its client left, or is refused by the retry
# budget, before anything is observed or marked. `flow_clock`, `flow` (optional) with `rank` and
# `half_ms` ('' without them): its flow in a fair tier.
# Returns: now_ms, waiting by class (4), being admitted by class (4), busy_ms,
#          completions in window, completions while busy, budget exhausted, budget retry_at,
#          in flight (claimed by replicas now),
#          ahead in its class (with a flow, in a fair tier: the calls of its class placed before
#          where ENQUEUE would place it now, `fleet.store.flows`; else -1)
# or the gate's answer (`fleet.store.retries`).
OBSERVE_AND_MARK = Script(
    "OBSERVE_AND_MARK", keys=("line", "completions", "budget", "admitting", "inflight", "retry", "retry_window"),
    optional_keys=("flow_clock", "flow"),
    args=("window_ms", "prefix", "member", "hold_ms", "digest", "attempt", "taken_ms", "ratio", "budget_s",
          "min_per_s", "rank", "half_ms"),
    consts={**LINE_CONSTS, **GATE_CONSTS, "BUDGET_EXHAUSTED": EXHAUSTED, "BUDGET_RETRY_AT": RETRY_AT},
    uses=(RETRY_GATE, BY_CLASS, FLOW_START), body="""
local gated = retry_gate(retry, retry_window, digest, attempt, tonumber(taken_ms), tonumber(ratio),
  tonumber(budget_s), tonumber(min_per_s))
if gated then return gated end
local by_class, oldest = by_class_of(line)
local out = {n2s(now), by_class[1], by_class[2], by_class[3], by_class[4]}
-- The marks of calls being admitted, those expired dropped: one call unless some expired.
local pend, stale = {0, 0, 0, 0}, false
local marks = redis.call('ZRANGE', admitting, 0, -1, 'WITHSCORES')
for i = 1, #marks, 2 do
  if tonumber(marks[i + 1]) <= now then
    stale = true
  else
    local r = tonumber(string.sub(marks[i], 1, 1)) + 1
    pend[r] = pend[r] + 1
  end
end
if stale then redis.call('ZREMRANGEBYSCORE', admitting, '-inf', n2s(now)) end
for r = 1, 4 do out[#out + 1] = pend[r] end
redis.call('ZADD', admitting, n2s(now + tonumber(hold_ms)), member)
redis.call('PEXPIRE', admitting, tonumber(hold_ms) * 2)
local busy = now - oldest
local window = tonumber(window_ms)
out[#out + 1] = n2s(busy)
out[#out + 1] = redis.call('ZCOUNT', completions, n2s(now - window), '+inf')
out[#out + 1] = redis.call('ZCOUNT', completions, n2s(now - math.min(busy, window)), '+inf')
local b = redis.call('HMGET', budget, BUDGET_EXHAUSTED, BUDGET_RETRY_AT)
out[#out + 1] = b[1] or '0'
out[#out + 1] = b[2] or ''
out[#out + 1] = redis.call('ZCARD', inflight)
if flow then
  local class = tonumber(rank)
  local start = flow_start(line, flow_clock, flow, class, tonumber(half_ms))
  out[#out + 1] = redis.call('ZCOUNT', line, n2s(class * CLASS_SPAN), '(' .. n2s(class * CLASS_SPAN + start))
else
  out[#out + 1] = -1
end
return out
""")


@dataclass(frozen=True, slots=True)
class AdmissionSnapshot:
    """The tier as one admission saw it, this request's mark included in nothing yet."""

    now_ms: int
    waiting: tuple[int, int, int, int]  # in the line, by class
    admitting: tuple[int, int, int, int]  # being admitted by other calls right now, by class
    busy_ms: int  # how long the line has been non-empty
    completions_in_window: int
    completions_while_busy: int  # within the busy spell (capped at the window)
    budget_exhausted: bool
    budget_retry_at: float | None  # epoch seconds
    ahead_in_class: int | None = None  # fair tier: its class's calls placed before it; None: all of them
    in_flight: int = 0  # claimed by replicas now (free slots are the ready replicas' less these)

    @property
    def line(self) -> tuple[int, int, int, int]:
        """Waiting plus being admitted: what a new call would queue behind."""
        w, a = self.waiting, self.admitting
        return (w[0] + a[0], w[1] + a[1], w[2] + a[2], w[3] + a[3])


@dataclass(frozen=True, slots=True)
class Attempt:
    """Who this attempt is, for the retry gate: its identity (`fleet.policy.retries.call_identity`;
    "" when it cannot be joined to another), its body's digest, and whether its SDK says it is a
    retry."""

    identity: str = ""
    digest: str = ""
    retry: bool = False
    taken_ms: int = 1  # how long a call this attempt takes over is held for it: its own deadline


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """The tier's retry budget as the gate applies it (`fleet.policy.retries.retry_allowed`)."""

    ratio: float = 0.2
    window_s: int = 10
    min_per_s: float = 3.0


@dataclass(frozen=True, slots=True)
class Gated:
    """What the retry gate answered instead of a snapshot: `JOINED` (with the call taken over),
    `RETRY_BUDGET_SPENT`, or `OTHER_BODY` (an Idempotency-Key sent with another body)."""

    verdict: int
    rid: str = ""
    tier: str = ""  # `JOINED`: the tier whose line holds the call, '' for the tier asked
    why: str = ""  # ... and why it was degraded there


class Admitting:
    """One namespace's admission view and marks (the scripts registered once)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._observe = named(redis.register_script(OBSERVE_AND_MARK))

    async def observe_and_mark(self, keys: TierKeys, prefix: str, member: str, window_ms: int,
                               place: tuple[int, Place] | None = None, attempt: Attempt = Attempt(),
                               budget: RetryBudget = RetryBudget()) -> AdmissionSnapshot | Gated:
        """The tier as this call sees it, marking it as being admitted. `place` (rank, place): in a
        fair tier, also how many of its class the line would put before it. First the retry gate:
        `Gated` when `attempt` takes over a parked call or the retry budget refuses it."""
        flow_clock, flow = place[1].keys(keys, place[0]) if place else (None, None)
        raw = await self._observe(
            line=keys.line, completions=keys.completions, budget=keys.budget, admitting=keys.admitting,
            inflight=keys.inflight, retry=keys.retry(attempt.identity), retry_window=keys.retry_window,
            flow_clock=flow_clock, flow=flow, window_ms=window_ms, prefix=prefix, member=member,
            hold_ms=ADMITTING_HOLD_MS, digest=attempt.digest if attempt.identity else "",
            attempt="retry" if attempt.retry else "first", taken_ms=attempt.taken_ms, ratio=budget.ratio,
            budget_s=budget.window_s, min_per_s=budget.min_per_s, rank=place[0] if place else "",
            half_ms=place[1].half_ms if place else "")
        if int(raw[0]) < 0:
            if int(raw[0]) == JOINED:
                return Gated(JOINED, _s(raw[1]), _s(raw[2]), _s(raw[3]))
            return Gated(int(raw[0]))
        retry_at = _s(raw[13])
        ahead = int(raw[15])
        return AdmissionSnapshot(
            now_ms=int(raw[0]), waiting=tuple(int(x) for x in raw[1:5]),  # type: ignore[arg-type]
            admitting=tuple(int(x) for x in raw[5:9]),  # type: ignore[arg-type]
            busy_ms=int(raw[9]), completions_in_window=int(raw[10]), completions_while_busy=int(raw[11]),
            budget_exhausted=_s(raw[12]) == "1", budget_retry_at=float(retry_at) if retry_at else None,
            ahead_in_class=ahead if ahead >= 0 else None, in_flight=int(raw[14]))

    async def unmark(self, keys: TierKeys, member: str) -> None:
        """The request was refused: it is no longer being admitted."""
        await self.redis.zrem(keys.admitting, member)


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
