"""What the scaler last decided for a tier, as the status page and `fleet status` read it.

The scaler writes `TierKeys.scaler` each tick; any part can read it back.
"""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis

from fleet.keys import TierKeys

_FLOATS = ("at", "calm_since", "prewarm_until", "startup_s", "ts")
_INTS = ("floor", "ceiling", "prewarm_floor", "delta", "desired", "deaths", "start_timeouts")


async def read_scaler_state(redis: Redis, keys: TierKeys, stale_after_s: float = 10.0) -> dict[str, Any] | None:
    """The scaler's last published state of the tier, or None when no scaler is
    running (nothing published, or the last tick is older than `stale_after_s`)."""
    raw = await redis.hgetall(keys.scaler)
    if not raw:
        return None
    d: dict[str, Any] = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                         for k, v in raw.items()}
    for f in _FLOATS:
        d[f] = float(d[f]) if d.get(f) not in (None, "") else None
    for f in _INTS:
        d[f] = int(d[f]) if d.get(f) not in (None, "") else None
    if d.get("ts") is None or time.time() - d["ts"] > stale_after_s:
        return None
    return d
