"""Replica heartbeats as the other parts read them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis

from fleet.keys import TierKeys


@dataclass(slots=True)
class Replica:
    id: str
    state: str  # starting | ready | draining
    slots: int
    in_use: int
    completed: int
    cold_start_s: float | None
    ts: float
    started: float
    pid: int

    def alive(self, now: float, heartbeat_s: float) -> bool:
        # Three missed beats: the process is gone or wedged.
        return now - self.ts < 3 * heartbeat_s + 1


async def read_replicas(redis: Redis, keys: TierKeys, heartbeat_s: float, now: float | None = None) -> list[Replica]:
    now = time.time() if now is None else now
    out = []
    for rid, raw in (await redis.hgetall(keys.replicas)).items():
        b = orjson.loads(raw)
        r = Replica(id=rid.decode() if isinstance(rid, bytes) else rid, state=b["state"], slots=b["slots"],
                    in_use=b["in_use"], completed=b["completed"], cold_start_s=b.get("cold_start_s"), ts=b["ts"],
                    started=b.get("started", b["ts"]), pid=b.get("pid", 0))
        if r.alive(now, heartbeat_s):
            out.append(r)
    return out


def by_state(replicas: list[Replica]) -> dict[str, int]:
    counts = {"starting": 0, "ready": 0, "draining": 0}
    for r in replicas:
        counts[r.state] = counts.get(r.state, 0) + 1
    return counts
