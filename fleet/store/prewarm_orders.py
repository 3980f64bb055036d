"""Operator pre-warms: `TierKeys.prewarm`, "hold this tier at N replicas or more until T".

Writer: the gateway's POST /v1/fleet/prewarm (`add_order`). Reader: the scaler,
each tick (`read_orders`, pruning the ones that ended), which hands them to the
policy (`fleet.policy.active_prewarm`) beside the config's scheduled windows.
"""

from __future__ import annotations

import uuid

import orjson
from redis.asyncio import Redis

from fleet.policy.prewarm import PrewarmOrder
from fleet.store.keys import TierKeys


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
