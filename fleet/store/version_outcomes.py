"""Finished calls by model version: `TierKeys.version_outcomes`, a capped stream.

Writer: the worker, once per call it ends (completed; or failed by the
fleet, or expired while running: an error), with its version and TTFT.
Reader: the scaler, over the judging window after a promotion, reading on
from where it stopped (`read_outcomes`); `fleet.policy.version_stats` and
`judge_rollout` turn them into the verdict. The stream's entry ids are
Redis-clock milliseconds, so "since the promotion" is a range read; the cap
bounds memory at any call rate.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from fleet.policy import Outcome
from fleet.store.keys import TierKeys

MAXLEN = 20_000  # the newest calls kept (approximately): minutes at a busy tier, enough for a window
READ_AT_MOST = 5_000  # per read; the reader comes back for the rest at its next tick


async def record_outcome(redis: Redis, keys: TierKeys, version: str, ok: bool, ttft_s: float) -> None:
    """One finished call of `version` (the worker's only write here); the TTFT counts only when ok."""
    await queue_outcome(redis, keys, version, ok, ttft_s)


def queue_outcome(redis: Any, keys: TierKeys, version: str, ok: bool, ttft_s: float) -> Any:
    """`record_outcome`'s write, on a client or queued on a pipeline (the worker sends it with its
    token charge, `Ledger.record_tokens(also=...)`): returns what the client's `xadd` does."""
    return redis.xadd(keys.version_outcomes, {"v": version, "ok": int(ok), "ttft": round(ttft_s, 6) if ok else -1},
                      maxlen=MAXLEN, approximate=True)


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


async def read_outcomes(redis: Redis, keys: TierKeys, *, since_s: float | None = None, after: str | None = None
                        ) -> tuple[list[Outcome], str | None]:
    """Calls finished since `since_s` (epoch seconds), or after the entry id `after` (where the last
    read stopped); returns them, oldest first, and the id to read on from (None: nothing read)."""
    start = f"({after}" if after else f"{int((since_s or 0) * 1000)}-0"
    out, last = [], None
    for eid, f in await redis.xrange(keys.version_outcomes, min=start, count=READ_AT_MOST):
        last = _s(eid)
        d = {_s(k): _s(v) for k, v in f.items()}
        try:
            ttft = float(d.get("ttft", -1))
            out.append(Outcome(at=int(last.split("-")[0]) / 1000, version=d.get("v", ""), ok=d.get("ok") == "1",
                               ttft_s=ttft if ttft >= 0 else None))
        except ValueError:  # an entry not of ours: skipped, never fatal
            continue
    return out, last
