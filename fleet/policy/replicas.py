"""A tier's replicas as the policy sees them: by state, with their slots. Pure; no I/O.

Live, they come from the heartbeats (and, for the scaler, from the replicas it
launched that have not beaten yet); in the simulator, from its replica model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ObservedReplica:
    id: str
    state: str  # starting | ready | draining
    slots: int  # requests it runs at once
    in_use: int  # requests it runs now
    started: float  # epoch seconds it was launched
    cold_start_s: float | None = None  # its engine's own start-up, once measured
    version: str = ""  # the model version it runs (the registry's), "" when unknown
    cached: int = 0  # prefixes it served lately (`fleet.store.affinity`): what its KV cache holds for the tier


@dataclass(frozen=True, slots=True)
class Replicas:
    """The replicas of one tier, counted by state."""

    members: tuple[ObservedReplica, ...] = ()
    ready: int = 0
    starting: int = 0
    draining: int = 0

    @classmethod
    def of(cls, members: Iterable[ObservedReplica]) -> Replicas:
        m = tuple(members)
        return cls(m, sum(r.state == "ready" for r in m), sum(r.state == "starting" for r in m),
                   sum(r.state == "draining" for r in m))

    @property
    def by_state(self) -> dict[str, int]:
        return {"starting": self.starting, "ready": self.ready, "draining": self.draining}


NO_REPLICAS = Replicas()


def scale_in_victims(members: Iterable[ObservedReplica], n: int = 1,
                     eligible: set[str] | None = None) -> list[ObservedReplica]:
    """Which replicas leave when a tier scales in by `n`: ready ones only (never one that is
    starting), the coldest prefix cache first (fewest prefixes served lately: the chains it
    leaves lose the least, `fleet.store.affinity`), then the fewest requests in flight (they
    drain soonest), the youngest on a tie. `eligible`: the ids the caller may drain (a
    supervisor drains only what it manages); None: any."""
    ready = [r for r in members if r.state == "ready" and (eligible is None or r.id in eligible)]
    ready.sort(key=lambda r: (r.cached, r.in_use, -r.started))
    return ready[:max(0, n)]
