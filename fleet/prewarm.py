"""Operator pre-warms in Redis: "hold this tier at N replicas or more until T".

The gateway's POST /v1/fleet/prewarm writes an order; the scaler reads the
orders each tick and hands them to the policy (`fleet.policy.active_prewarm`),
which combines them with the scheduled windows of the config.
"""

from __future__ import annotations

import re
import uuid

import orjson
from redis.asyncio import Redis

from fleet.keys import TierKeys
from fleet.policy import PrewarmOrder

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def duration_s(text: str) -> float:
    """'45m', '90s', '1h30m', '2h' or a bare number of seconds -> seconds (>= 0)."""
    t = text.strip().lower().replace(" ", "")
    try:
        secs = float(t)
    except ValueError:
        parts = _PART.findall(t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise ValueError(f"not a duration: {text!r} (use e.g. 45m, 90s, 1h30m)") from None
        secs = sum(float(n) * _UNITS[u] for n, u in parts)
    if secs < 0:
        raise ValueError(f"duration must not be negative, got {text!r}")
    return secs


def parse_duration(text: str) -> float:
    """A duration that must be positive (a pre-warm's length)."""
    secs = duration_s(text)
    if secs <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return secs


async def add_order(redis: Redis, keys: TierKeys, floor: int, until: float, now: float) -> PrewarmOrder:
    order = PrewarmOrder(floor=floor, until=until, id=uuid.uuid4().hex[:12])
    await redis.hset(keys.prewarm, order.id, orjson.dumps({"floor": floor, "until": until, "created": now}))
    return order


async def read_orders(redis: Redis, keys: TierKeys, now: float, *, prune: bool = False) -> list[PrewarmOrder]:
    """The orders still in force; with `prune`, expired ones are deleted (the scaler does this)."""
    live: list[PrewarmOrder] = []
    dead: list[str] = []
    for oid, raw in (await redis.hgetall(keys.prewarm)).items():
        name = oid.decode() if isinstance(oid, bytes) else str(oid)
        try:
            b = orjson.loads(raw)
            order = PrewarmOrder(floor=int(b["floor"]), until=float(b["until"]), id=name)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            dead.append(name)  # unreadable: drop it rather than let it wedge the scaler
            continue
        if order.until > now:
            live.append(order)
        else:
            dead.append(name)
    if prune and dead:
        await redis.hdel(keys.prewarm, *dead)
    return live
