"""The tier's calibrated capacity, as the scaler last published it: `TierKeys.capacity`.

Writer: the acting scaler, each tick (`publish_calibration`). Reader: the
gateways' admission, each heartbeat (`read_calibration`), so that what a cold
tier's callers are told about its start-up, and how fast its line drains, rests
on what replicas measured, not only on the config. A calibration older than
`stale_after_s` (no scaler running) is not used: the gateway then calibrates the
start-up from the heartbeats itself, and the throughput is the profile's.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis

from fleet.policy.calibration import Calibration
from fleet.store.keys import TierKeys


async def publish_calibration(redis: Redis, keys: TierKeys, cal: Calibration, now: float) -> None:
    await redis.hset(keys.capacity, mapping={
        "startup_s": f"{cal.startup_s:.6f}", "rate_factor": f"{cal.rate_factor:.6f}",
        "measured_startups": cal.measured_startups, "ready": cal.ready,
        "ready_since": "" if cal.ready_since is None else f"{cal.ready_since:.3f}", "ts": f"{now:.3f}"})


async def read_calibration(redis: Redis, keys: TierKeys, stale_after_s: float | None = 10.0
                           ) -> Calibration | None:
    """The published calibration, or None when there is none (or, with `stale_after_s`, only an old one)."""
    raw = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
           for k, v in (await redis.hgetall(keys.capacity)).items()}
    try:
        ts = float(raw["ts"])
        if stale_after_s is not None and time.time() - ts > stale_after_s:
            return None
        return Calibration(startup_s=float(raw["startup_s"]), rate_factor=float(raw["rate_factor"]),
                           measured_startups=int(raw.get("measured_startups", 0)), ready=int(raw.get("ready", 0)),
                           ready_since=float(raw["ready_since"]) if raw.get("ready_since") else None)
    except (KeyError, TypeError, ValueError):
        return None
