"""Replica heartbeats: `TierKeys.replicas`, one JSON record per replica id.

Writer: the replica itself (`workers.worker`), every heartbeat, and its last
act on a clean exit is to remove its record. The supervisor removes the record
of a replica it killed (a killed process cannot), so the dead do not count as
alive for a few more beats. Reader: `read_heartbeats`, for everyone (the
scaler, the gateway's admission, status and metrics, the budget governor,
`fleet up`), which keeps only the live ones.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import orjson
from redis.asyncio import Redis

from fleet.policy.cold_start import ColdStartPhases
from fleet.store.keys import TierKeys

ReplicaState = Literal["starting", "ready", "draining"]
STATES: tuple[ReplicaState, ...] = ("starting", "ready", "draining")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What one replica says about itself, each beat."""

    id: str
    state: ReplicaState
    slots: int  # requests it runs at once (its concurrency: slots bounded by its KV cache)
    in_use: int
    completed: int
    cold_start_s: float | None  # its engine's measured start-up, once started
    ts: float  # epoch seconds of this beat
    started: float  # epoch seconds the process started
    pid: int = 0
    engine: str = ""
    version: str = ""  # the model version it runs (`fleet.store.model_registry`)
    cold_start_phases: ColdStartPhases | None = None  # its cold start by phase, once started (when its engine says)

    def alive(self, now: float, heartbeat_s: float) -> bool:
        """Three missed beats (and a second): the process is gone or wedged."""
        return now - self.ts < 3 * heartbeat_s + 1

    def dumps(self) -> bytes:
        d = asdict(self)
        d.pop("id")
        d["cold_start_phases"] = None if self.cold_start_phases is None else self.cold_start_phases.as_dict()
        return orjson.dumps(d)

    @classmethod
    def loads(cls, rid: str, raw: bytes | str) -> Heartbeat:
        b: dict[str, Any] = orjson.loads(raw)
        return cls(id=rid, state=b["state"], slots=int(b["slots"]), in_use=int(b["in_use"]),
                   completed=int(b["completed"]), cold_start_s=b.get("cold_start_s"), ts=float(b["ts"]),
                   started=float(b.get("started", b["ts"])), pid=int(b.get("pid", 0)), engine=b.get("engine", ""),
                   version=b.get("version", ""),
                   cold_start_phases=ColdStartPhases.from_dict(b["cold_start_phases"]) if b.get("cold_start_phases")
                   else None)


async def write_heartbeat(redis: Redis, keys: TierKeys, beat: Heartbeat) -> None:
    """The replica's beat (its only writer while it lives)."""
    await redis.hset(keys.replicas, beat.id, beat.dumps())


async def remove_heartbeat(redis: Redis, keys: TierKeys, replica: str) -> None:
    """The replica left (or was killed by its supervisor): it no longer counts."""
    await redis.hdel(keys.replicas, replica)


async def read_heartbeats(redis: Redis, keys: TierKeys, heartbeat_s: float, now: float | None = None
                          ) -> list[Heartbeat]:
    """The live replicas of a tier; an unreadable record is skipped, never fatal."""
    now = time.time() if now is None else now
    out = []
    for rid, raw in (await redis.hgetall(keys.replicas)).items():
        try:
            beat = Heartbeat.loads(rid.decode() if isinstance(rid, bytes) else str(rid), raw)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        if beat.alive(now, heartbeat_s):
            out.append(beat)
    return out


def count_by_state(beats: list[Heartbeat]) -> dict[str, int]:
    """Replicas per state, every state present."""
    counts: dict[str, int] = dict.fromkeys(STATES, 0)
    for b in beats:
        counts[b.state] = counts.get(b.state, 0) + 1
    return counts
