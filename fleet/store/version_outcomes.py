"""Finished calls by model version: `TierKeys.version_outcomes`, a capped stream.

Writer: the worker, once per call it ends (completed; or failed by the
fleet, or expired while running: an error), with its version and TTFT.
Reader: the scaler, over the judging window after a promotion
(`fleet.policy.judge_rollout` compares the two versions' figures). The
stream's entry ids are Redis-clock milliseconds, so "since the promotion"
is a range read; the cap bounds memory at any call rate.
"""

from __future__ import annotations

from collections import defaultdict

from redis.asyncio import Redis

from fleet.policy import VersionStats, p99
from fleet.store.keys import TierKeys

MAXLEN = 20_000  # the newest calls kept (approximately): minutes at a busy tier, enough for a window
READ_AT_MOST = 20_000


async def record_outcome(redis: Redis, keys: TierKeys, version: str, ok: bool, ttft_s: float) -> None:
    """One finished call of `version` (the worker's only write here); the TTFT counts only when ok."""
    await redis.xadd(keys.version_outcomes, {"v": version, "ok": int(ok), "ttft": round(ttft_s, 6) if ok else -1},
                     maxlen=MAXLEN, approximate=True)


async def version_stats(redis: Redis, keys: TierKeys, since_s: float) -> dict[str, VersionStats]:
    """Calls finished since `since_s` (epoch seconds), by version: count, errors, TTFT p99."""
    calls: dict[str, int] = defaultdict(int)
    errors: dict[str, int] = defaultdict(int)
    ttfts: dict[str, list[float]] = defaultdict(list)
    for _, f in await redis.xrange(keys.version_outcomes, min=f"{int(since_s * 1000)}-0", count=READ_AT_MOST):
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in f.items()}
        v = d.get("v", "")
        calls[v] += 1
        if d.get("ok") != "1":
            errors[v] += 1
        elif float(d.get("ttft", -1)) >= 0:
            ttfts[v].append(float(d["ttft"]))
    return {v: VersionStats(calls=n, errors=errors[v], ttft_p99_s=p99(ttfts[v])) for v, n in calls.items()}
