"""The fair line's memory of its flows (`fleet.policy.fairness`, docs/fair-line.md).

Two key families of a tier, both under its hash tag:

- `flows:clock` HASH class rank -> the class's clock (`TierKeys.flow_clock`): the highest
  head of the class seen at an enqueue, so a flow arriving at an empty class starts where
  the last ones were, not at zero;
- `flow:<rank>:<flow>` STRING "tag|at_ms|last call" (`TierKeys.flow`): where the flow's next
  call would start in its class, when its last call joined and which one, with a TTL of ten
  half-lives past that call's deadline (by then what it was served is forgiven).

Writer: the line's ENQUEUE, atomically with the call's place (`fleet.store.line_scripts`).
Reader: the gateway's admission view (`fleet.store.admitting`), which computes the same start
without writing, to count only the calls that will go before a new one; and `read_flow` here,
for tests and operators. No gateway or worker keeps flow state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.policy.fairness import FlowTag
from fleet.store.keys import TierKeys

# A Lua function (needs the clock and `CLASS_SPAN`, `fleet.store.line_lua.LINE_CONSTS`).
# `flow_start(line, clock, flow, rank, half_ms)` returns the start tag of the flow's next call
# in class `rank`, the class clock it was judged on and the clock as stored (ENQUEUE raises
# it); the rule is `fleet.policy.fairness.flow_start` (kept alike: tests/store/test_fair_line.py compares them).
FLOW_START = """
local function flow_start(line, clock, fkey, rank, half_ms)
  local lo = rank * CLASS_SPAN
  local stored = tonumber(redis.call('HGET', clock, rank) or '0')
  local v = stored
  local head = redis.call('ZRANGEBYSCORE', line, n2s(lo), '(' .. n2s(lo + CLASS_SPAN), 'WITHSCORES', 'LIMIT', 0, 1)
  if #head > 0 then v = math.max(v, tonumber(head[2]) - lo + 1) end  -- just after the head, never level
  local rec = redis.call('GET', fkey)
  if not rec then return math.floor(v), v, stored end
  local tag, at, last = string.match(rec, '^([^|]*)|([^|]*)|(.*)$')
  tag = tonumber(tag)
  if tag <= v then return math.floor(v), v, stored end
  -- still waiting: it goes after its own last call
  if #head > 0 and redis.call('ZSCORE', line, last) then return math.floor(tag), v, stored end
  return math.floor(v + (tag - v) * 2 ^ (-math.max(0, now - tonumber(at)) / half_ms)), v, stored
end
"""


@dataclass(frozen=True, slots=True)
class Place:
    """How a call of a fair tier is placed in its class: its flow and what it costs (`call_cost`)."""

    flow: str
    cost: int
    half_life_s: float

    def keys(self, keys: TierKeys, rank: int) -> list[str]:
        return [keys.flow_clock, keys.flow(rank, self.flow)]

    @property
    def half_ms(self) -> int:
        return max(1, int(self.half_life_s * 1000))


def encode_flow(tag: float, at_ms: int, last: str) -> str:
    """The record as ENQUEUE writes it (the Lua builds the same string)."""
    return f"{tag:.0f}|{at_ms}|{last}"


def decode_flow(raw: bytes | str) -> FlowTag:
    s = raw.decode() if isinstance(raw, bytes) else raw
    tag, at, last = s.split("|", 2)
    return FlowTag(float(tag), int(at), last)


async def read_flow(redis: Redis, keys: TierKeys, rank: int, flow: str) -> FlowTag | None:
    """One flow's record in one class, or None (never seen, or forgiven and expired)."""
    raw = await redis.get(keys.flow(rank, flow))
    return decode_flow(raw) if raw is not None else None


async def read_clock(redis: Redis, keys: TierKeys) -> dict[int, float]:
    """Each class's clock (rank -> units); a class never enqueued in a fair tier is absent."""
    raw = await redis.hgetall(keys.flow_clock)
    return {int(k): float(v) for k, v in raw.items()}
