"""What the scaler decided for a tier: `TierKeys.scaler` (the latest) and `TierKeys.decisions` (the stream).

Writer: the acting scaler, each tick (`write_scaler_state`, `append_decision`,
`append_event`, `count`). Readers: the status page and `fleet status`
(`read_scaler_state`, which calls a state older than `stale_after_s` "no
scaler running"), and a scaler taking over the lease, which resumes the hold
and the measured start-up from the last state whatever its age. Operators read
the stream with `redis-cli XRANGE`; tests read it the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

from redis.asyncio import Redis

from fleet.store.keys import TierKeys

STREAM_MAXLEN = 1000
COUNTERS = ("deaths", "start_timeouts", "launch_failures", "tick_failures")


@dataclass(frozen=True, slots=True)
class ScalerState:
    """The scaler's last tick for one tier. Counters (`COUNTERS`) only ever grow."""

    floor: int
    ceiling: int
    ceiling_by: str
    desired: int
    action: str
    delta: int
    reason: str
    code: str
    at: float  # when it decided (epoch seconds)
    ts: float  # when it published (epoch seconds); the freshness the readers judge
    scaler: str  # the scaler's id
    ready: int = 0
    starting: int = 0
    draining: int = 0
    prewarm_floor: int = 0
    prewarm_until: float | None = None
    prewarm_source: str = ""
    calm_since: float | None = None
    calm_keep: int = 0  # the highest need seen since calm_since: a new leader resumes the hold with it
    startup_s: float | None = None  # the start-up the scaler expects (measured, else modelled)
    tick_s: float | None = None  # how often it ticks: a pre-warm's margin
    ready_cold_s: float | None = None  # the cold start a `ready_at` window plans with (`ColdStart`)
    ready_cold_measured: int = 0
    ready_cold_source: str = ""
    last_action: str = ""  # the last action other than hold, and its reason and time
    last_reason: str = ""
    last_at: float | None = None
    deaths: int = 0
    start_timeouts: int = 0
    launch_failures: int = 0
    tick_failures: int = 0

    def fields(self) -> dict[str, str | int | float]:
        """The hash fields; None becomes "" (Redis has no null). Counters are left to `count`."""
        out: dict[str, str | int | float] = {}
        for f in fields(self):
            if f.name in COUNTERS:
                continue
            v = getattr(self, f.name)
            if f.name.startswith("last_") and not v:
                continue  # a hold leaves the last action as it was
            out[f.name] = "" if v is None else v
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> ScalerState:
        d = {_s(k): _s(v) for k, v in raw.items()}
        kw: dict[str, Any] = {}
        for f in fields(cls):
            v = d.get(f.name, "")
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if "int" in kind:
                kw[f.name] = int(float(v)) if v != "" else 0
            elif "float" in kind:
                kw[f.name] = float(v) if v != "" else (None if "None" in kind else 0.0)
            else:
                kw[f.name] = v
        return cls(**kw)


async def write_scaler_state(redis: Redis, keys: TierKeys, state: ScalerState) -> None:
    await redis.hset(keys.scaler, mapping=state.fields())


async def count(redis: Redis, keys: TierKeys, counter: str) -> None:
    """One more death, start timeout, launch failure or failed tick."""
    assert counter in COUNTERS, counter
    await redis.hincrby(keys.scaler, counter, 1)


async def read_scaler_state(redis: Redis, keys: TierKeys, stale_after_s: float | None = 10.0
                            ) -> ScalerState | None:
    """The scaler's last state of the tier, or None when none was published or (with
    `stale_after_s`) the last is older than that: no scaler is running."""
    raw = await redis.hgetall(keys.scaler)
    if not raw or (b"ts" not in raw and "ts" not in raw):
        return None
    try:
        state = ScalerState.from_hash(raw)
    except (TypeError, ValueError):
        return None
    if stale_after_s is not None and time.time() - state.ts > stale_after_s:
        return None
    return state


async def append_decision(redis: Redis, keys: TierKeys, *, action: str, delta: int, reason: str, code: str,
                          floor: int, ceiling: int, at: float, scaler: str) -> None:
    await redis.xadd(keys.decisions, {"kind": "decision", "action": action, "delta": delta, "reason": reason,
                                      "code": code, "floor": floor, "ceiling": ceiling, "at": at, "scaler": scaler},
                     maxlen=STREAM_MAXLEN, approximate=True)


async def append_event(redis: Redis, keys: TierKeys, *, event: str, replica: str, reason: str, at: float,
                       scaler: str) -> None:
    await redis.xadd(keys.decisions, {"kind": "event", "event": event, "replica": replica, "reason": reason,
                                      "at": at, "scaler": scaler}, maxlen=STREAM_MAXLEN, approximate=True)


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
