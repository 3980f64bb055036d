"""The spend ledger: every replica-second and every token of a tier, in Redis.

Exact and persistent: Redis is the only place it lives, so a restart of the
gateway, the scaler or any worker loses nothing already written.

Replica-seconds come from heartbeats. Each beat runs `ACCRUE`, which charges
the time since the replica's last accrual (kept per replica in
`ledger:beats` as "ms|state|process start ms") to the state the replica was in over that
interval, then moves the mark to now. Time is partitioned by that one mark,
so a beat repeated, or the same replica reported by two parts, never counts
a second twice. A replica's first beat charges from its process start, as
`starting`: a replica loading weights holds its GPUs and costs money (the
cold-start tax). Its last beat, on a clean exit, leaves a `gone` mark. A
replica that is killed loses at most the interval since its last beat. A
replica id reused by a new process (a supervisor restarting `routing-1`) is
a new incarnation, told apart by its process start time.

Tokens come from the worker when a request ends: all tokens generated are
charged (per-token price where the tier has one); completion tokens of a
request completed within its deadline are also counted as *useful*, the
chapter's denominator for cost per token. Late, failed or cancelled tokens
cost, but are not useful.

Layout, per tier (hash tag `{tier}`, see `fleet.store.keys`): one HASH per UTC day,
`ledger:d:<day>`, with each amount at three grains, `m<minute>:<kind>`,
`h<hour>:<kind>` and `d:<kind>`, so any window, whenever it was configured,
is summed from a few dozen fields (whole days, whole hours, then minutes at
the edges). Windows resolve to the minute; cron starts are minute-aligned.
Money is integer nano-dollars, so sums are exact. `ledger:total` keeps the
lifetime totals and tokens by key and class.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from fleet.config import TierConfig
from fleet.store.keys import TierKeys
from fleet.store.lua import CLOCK

NANO = 1_000_000_000
STATES = ("starting", "ready", "draining")
KINDS = ("rs:starting", "rs:ready", "rs:draining", "usd", "usdt", "tok", "ctok", "useful")
RETAIN_DAYS = 40  # day hashes expire after this; named windows and the day never reach back further
MAX_GAP_S = 300.0  # a longer silence is charged only this much (the last MAX_GAP_S before the beat that ends it)

# KEYS: beats total ; ARGV: day_prefix replica state started_ms hourly_nano cap_ms final ttl_s
ACCRUE = CLOCK + """
local prev = redis.call('HGET', KEYS[1], ARGV[2])
local from, st = tonumber(ARGV[4]), 'starting'
if prev then
  local a = string.find(prev, '|', 1, true)
  local b = string.find(prev, '|', a + 1, true)
  local mark, was, born = tonumber(string.sub(prev, 1, a - 1)), string.sub(prev, a + 1, b - 1), string.sub(prev, b + 1)
  if born == ARGV[4] then
    if was == 'gone' then return 0 end
    from, st = mark, was
  elseif mark > from then
    -- A new process under a reused replica id: charge from its own start, never
    -- over time already charged to the previous one.
    from = mark
  end
end
local cap = tonumber(ARGV[6])
if from < now - cap then from = now - cap end
if from > now then from = now end
local per_ms = tonumber(ARGV[5]) / 3600000
local ttl = tonumber(ARGV[8])
local total_ms, total_nano = 0, 0
local at = from
while at < now do
  local minute = math.floor(at / 60000)
  local seg = math.min(now, (minute + 1) * 60000) - at
  local nano = math.floor(seg * per_ms + 0.5)
  local key = ARGV[1] .. n2s(math.floor(minute / 1440))
  for _, p in ipairs({'m' .. n2s(minute) .. ':', 'h' .. n2s(math.floor(minute / 60)) .. ':', 'd:'}) do
    redis.call('HINCRBY', key, p .. 'rs:' .. st, n2s(seg))
    if nano > 0 then redis.call('HINCRBY', key, p .. 'usd', n2s(nano)) end
  end
  redis.call('EXPIRE', key, ttl)
  total_ms = total_ms + seg
  total_nano = total_nano + nano
  at = at + seg
end
if total_ms > 0 then redis.call('HINCRBY', KEYS[2], 'rs:' .. st, n2s(total_ms)) end
if total_nano > 0 then redis.call('HINCRBY', KEYS[2], 'usd', n2s(total_nano)) end
local mark = ARGV[3]
if ARGV[7] == '1' then mark = 'gone' end
redis.call('HSET', KEYS[1], ARGV[2], n2s(now) .. '|' .. mark .. '|' .. ARGV[4])
return total_ms
"""

# KEYS: total ; ARGV: day_prefix key class prompt completion useful(0|1) nano_per_token ttl_s
TOKENS = CLOCK + """
local minute = math.floor(now / 60000)
local key = ARGV[1] .. n2s(math.floor(minute / 1440))
local pt, ct = tonumber(ARGV[4]), tonumber(ARGV[5])
local useful = 0
if ARGV[6] == '1' then useful = ct end
local nano = math.floor((pt + ct) * tonumber(ARGV[7]) + 0.5)
for _, p in ipairs({'m' .. n2s(minute) .. ':', 'h' .. n2s(math.floor(minute / 60)) .. ':', 'd:'}) do
  redis.call('HINCRBY', key, p .. 'tok', n2s(pt + ct))
  redis.call('HINCRBY', key, p .. 'ctok', n2s(ct))
  if useful > 0 then redis.call('HINCRBY', key, p .. 'useful', n2s(useful)) end
  if nano > 0 then
    redis.call('HINCRBY', key, p .. 'usd', n2s(nano))
    redis.call('HINCRBY', key, p .. 'usdt', n2s(nano))
  end
end
local kc = 'k|' .. ARGV[2] .. '|' .. ARGV[3] .. '|'
for _, h in ipairs({key, KEYS[1]}) do
  redis.call('HINCRBY', h, kc .. 'pt', n2s(pt))
  redis.call('HINCRBY', h, kc .. 'ct', n2s(ct))
  if useful > 0 then redis.call('HINCRBY', h, kc .. 'ut', n2s(useful)) end
end
redis.call('HINCRBY', KEYS[1], 'tok', n2s(pt + ct))
redis.call('HINCRBY', KEYS[1], 'ctok', n2s(ct))
if useful > 0 then redis.call('HINCRBY', KEYS[1], 'useful', n2s(useful)) end
if nano > 0 then
  redis.call('HINCRBY', KEYS[1], 'usd', n2s(nano))
  redis.call('HINCRBY', KEYS[1], 'usdt', n2s(nano))
end
redis.call('EXPIRE', key, tonumber(ARGV[8]))
return nano
"""


@dataclass(slots=True)
class Spend:
    """What a tier spent over a period."""

    usd: float = 0.0
    token_usd: float = 0.0  # the per-token part of `usd`
    replica_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATES, 0.0))
    tokens: int = 0  # prompt + completion, every attempt
    completion_tokens: int = 0
    useful_tokens: int = 0  # completion tokens of requests completed within their deadline

    @property
    def replica_hours(self) -> float:
        return sum(self.replica_s.values()) / 3600.0

    @classmethod
    def from_fields(cls, f: dict[str, int]) -> Spend:
        return cls(usd=f.get("usd", 0) / NANO, token_usd=f.get("usdt", 0) / NANO,
                   replica_s={s: f.get(f"rs:{s}", 0) / 1000 for s in STATES}, tokens=f.get("tok", 0),
                   completion_tokens=f.get("ctok", 0), useful_tokens=f.get("useful", 0))


def plan_fields(start_s: float, end_s: float) -> dict[int, list[str]]:
    """Field prefixes covering the minutes [start, end): day -> prefixes.

    Whole UTC days as `d:`, whole hours as `h<hour>:`, the rest as
    `m<minute>:`. The minute holding `start` is included; a window end is
    rounded up to its minute so the current, partial minute counts.
    """
    m, end = int(start_s // 60), -int(-end_s // 60)
    out: dict[int, list[str]] = {}
    while m < end:
        day = m // 1440
        if m % 1440 == 0 and m + 1440 <= end:
            out.setdefault(day, []).append("d:")
            m += 1440
        elif m % 60 == 0 and m + 60 <= end:
            out.setdefault(day, []).append(f"h{m // 60}:")
            m += 60
        else:
            out.setdefault(day, []).append(f"m{m}:")
            m += 1
    return out


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


@dataclass(frozen=True, slots=True)
class TokenCharge:
    """One attempt's tokens to charge (`Ledger.record_many`); `also(pipeline)` queues the
    caller's own writes in the same round trip (see `Ledger.record_tokens`)."""

    key: str
    priority: str
    prompt: int
    completion: int
    useful: bool
    also: Callable[[Any], Any] | None = None


class Ledger:
    """One tier's spend ledger. Safe to share across tasks; each write is one Lua call."""

    def __init__(self, redis: Redis, namespace: str, tier: str, tc: TierConfig) -> None:
        self.redis = redis
        self.tier = tier
        self.tc = tc
        self.keys = TierKeys(namespace, tier)
        self.day_prefix = self.keys.ledger_day(0)[:-1]
        self._accrue = redis.register_script(ACCRUE)
        self._tokens = redis.register_script(TOKENS)

    @property
    def hourly_nano(self) -> int:
        return round(self.tc.hourly_usd * NANO)

    @property
    def token_nano(self) -> float:
        """Nano-dollars per token at the tier's per-token price (0 without one)."""
        return (self.tc.usd_per_million_tokens or 0.0) * NANO / 1e6

    async def accrue(self, replica: str, state: str, started_s: float, *, final: bool = False) -> float:
        """Charge this replica's time since its last accrual; returns seconds charged.

        `state` is the replica's state from now on; the interval just ended is
        charged to the state recorded at the previous accrual. `final` marks
        the replica gone (a clean exit) so nothing is charged for it again.
        """
        ms = await self._accrue(
            keys=[self.keys.ledger_beats, self.keys.ledger_total],
            args=[self.day_prefix, replica, state, int(started_s * 1000), self.hourly_nano, int(MAX_GAP_S * 1000),
                  "1" if final else "0", RETAIN_DAYS * 86400],
        )
        return int(ms) / 1000

    async def record_tokens(self, key: str, priority: str, prompt: int, completion: int, *, useful: bool,
                            also: Callable[[Any], Any] | None = None) -> None:
        """Charge the tokens one request attempt generated. Call once per attempt.

        `also(pipeline)` queues the caller's own writes (a worker's version outcome) to go out in
        the same round trip as the charge; they run even when there is nothing to charge."""
        await self.record_many([TokenCharge(key, priority, prompt, completion, useful, also)])

    async def record_many(self, charges: Sequence[TokenCharge]) -> None:
        """Charge many attempts (each as `record_tokens` would) in one round trip: a replica
        charges the calls that ended within one pace together. Raises the first error, once every
        charge was tried."""
        runs: list[tuple[int, list[Any], list[Any]]] = []  # (position in the pipeline, keys, args)
        async with self.redis.pipeline(transaction=False) as p:
            for c in charges:
                keys = [self.keys.ledger_total]
                args = [self.day_prefix, c.key or "-", c.priority, max(0, c.prompt), max(0, c.completion),
                        "1" if c.useful else "0", self.token_nano, RETAIN_DAYS * 86400]
                if c.prompt > 0 or c.completion > 0:
                    runs.append((len(p), keys, args))
                    # EVALSHA itself: a Script on a pipeline costs a SCRIPT EXISTS round trip first;
                    # as a command, not `p.evalsha`, which a cluster pipeline refuses (the charges of
                    # a replica on Redis Cluster were lost, each batch logged as failed)
                    p.execute_command("EVALSHA", self._tokens.sha, len(keys), *keys, *args)
                if c.also is not None:
                    c.also(p)
            if not len(p):
                return
            got = await p.execute(raise_on_error=False)
        for at, keys, args in runs:
            if isinstance(got[at], NoScriptError):  # not run (Redis lost its scripts): run it now, once
                got[at] = await self._tokens(keys=keys, args=args)
        for r in got:
            if isinstance(r, Exception):
                raise r

    async def _fields(self, plan: dict[int, list[str]], kinds: tuple[str, ...]) -> dict[str, int]:
        days = list(plan)
        async with self.redis.pipeline(transaction=False) as p:
            for day in days:
                p.hmget(self.keys.ledger_day(day), [pre + k for pre in plan[day] for k in kinds])
            rows = await p.execute()
        total: dict[str, int] = dict.fromkeys(kinds, 0)
        for vals in rows:  # each row is prefixes x kinds, kinds varying fastest
            for i, v in enumerate(vals):
                if v is not None:
                    total[kinds[i % len(kinds)]] += int(v)
        return total

    async def window(self, start_s: float, end_s: float, kinds: tuple[str, ...] = KINDS) -> Spend:
        """What the tier spent over [start, end), to the minute."""
        if end_s <= start_s:
            return Spend()
        return Spend.from_fields(await self._fields(plan_fields(start_s, end_s), kinds))

    async def spent_usd(self, start_s: float, end_s: float) -> float:
        return (await self.window(start_s, end_s, ("usd",))).usd

    async def token_usd_since(self, start: float, now: float) -> float:
        """What the tier's tokens cost over [start, now) (0 for a tier without a per-token price)."""
        if not self.tc.usd_per_million_tokens:
            return 0.0
        return (await self.window(start, now, ("usdt",))).token_usd

    async def totals(self) -> Spend:
        raw = await self.redis.hgetall(self.keys.ledger_total)
        return Spend.from_fields({_s(k): int(v) for k, v in raw.items() if not _s(k).startswith("k|")})

    async def tokens_by_key(self, day: int | None = None) -> dict[tuple[str, str], dict[str, int]]:
        """Tokens by (key, class): prompt `pt`, completion `ct`, useful `ut`.
        Lifetime, or one UTC day (epoch day number)."""
        h = self.keys.ledger_total if day is None else self.keys.ledger_day(day)
        out: dict[tuple[str, str], dict[str, int]] = {}
        for k, v in (await self.redis.hgetall(h)).items():
            name = _s(k)
            if name.startswith("k|"):
                key, cls, kind = name[2:].rsplit("|", 2)
                out.setdefault((key, cls), {"pt": 0, "ct": 0, "ut": 0})[kind] = int(v)
        return out

    async def forget_gone(self, now: float | None = None, older_than_s: float = 3600.0) -> int:
        """Drop accrual marks of replicas silent for longer than `older_than_s`."""
        now = time.time() if now is None else now
        stale = [k for k, v in (await self.redis.hgetall(self.keys.ledger_beats)).items()
                 if int(_s(v).split("|", 1)[0]) < (now - older_than_s) * 1000]
        if stale:
            await self.redis.hdel(self.keys.ledger_beats, *stale)
        return len(stale)
