"""The live reader: a tier's `TierObservation` from what Redis holds now.

The store's records (the line, the heartbeats, the budget judgement) are read
here and put in the policy's one shape, so the gateway's status and metrics
and the scaler observe a tier the same way. (The gateway's admission builds
the same shape from its one-round-trip view, `fleet.store.admitting`.)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.policy.observation import TierObservation, budget_signal, observe_tier
from fleet.policy.replicas import ObservedReplica
from fleet.store.affinity import cached_prefixes
from fleet.store.heartbeats import Heartbeat, read_heartbeats
from fleet.store.line import Line, LineSnapshot
from fleet.store.tier_budget import BudgetState, read_budget_state


def observed(beat: Heartbeat, state: str | None = None, cached: int = 0) -> ObservedReplica:
    """A heartbeat as the policy sees a replica (`state` overrides what it says of itself; `cached`:
    the prefixes it holds, `fleet.store.affinity.cached_prefixes`)."""
    return ObservedReplica(id=beat.id, state=state or beat.state, slots=beat.slots, in_use=beat.in_use,
                           started=beat.started, cold_start_s=beat.cold_start_s, version=beat.version, cached=cached)


def observation_of(tier: str, snap: LineSnapshot, replicas: Iterable[ObservedReplica], budget: BudgetState | None,
                   *, window_s: float, now: float, startups_measured: Iterable[float] = ()) -> TierObservation:
    return observe_tier(
        tier, now, window_s, line=snap.by_class, oldest_wait_s=snap.oldest_wait_s, in_flight=snap.inflight,
        arrivals_in_window=snap.arrivals_in_window, completions_in_window=snap.completions_in_window,
        replicas=replicas, startups_measured=startups_measured,
        budget=budget_signal(budget.view if budget is not None else None))


@dataclass(frozen=True, slots=True)
class LiveTier:
    """One tier read from Redis: the observation, and the records it was built from."""

    obs: TierObservation
    snap: LineSnapshot  # with the outcome counters
    beats: list[Heartbeat]
    budget: BudgetState | None


async def read_tier(redis: Redis, line: Line, *, heartbeat_s: float, window_s: float,
                    now: float | None = None) -> LiveTier:
    now = time.time() if now is None else now
    snap = await line.observe()
    beats = await read_heartbeats(redis, line.keys, heartbeat_s, now)
    budget = await read_budget_state(redis, line.keys)
    cached = await cached_prefixes(redis, line.keys)
    return LiveTier(observation_of(line.tier, snap, (observed(b, cached=cached.get(b.id, 0)) for b in beats), budget,
                                   window_s=window_s, now=now), snap, beats, budget)
