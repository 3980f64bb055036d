"""A tier's replicas as the policy sees them: by state, with their slots, and their health
(how long a start may take, when a silent replica is wedged). Pure; no I/O, no clock.

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


# --- replica health: how long a start may take, when a silent replica is wedged ---

_TIMEOUT_DOUBLINGS = 6  # at most 64x: enough to reach a real engine's minutes from a sim profile's seconds
BEATING_START_FACTOR = 10.0  # a replica beating `starting` is loading: it gets this many times the limit...
BEATING_START_MIN_S = 600.0  # ...and at least this long, before it is judged stuck


def start_timeout_s(startup_s: float, consecutive: int = 0, beating: bool = False) -> float:
    """How long a replica may take to become ready before it is stopped and reported.

    Twice the expected start-up plus a margin: a loaded box is slower, but a
    replica that never gets there must not be waited on forever. The expected
    start-up may come from the sim profile (2 s) while the engine is real
    (vLLM: 20-60 s), so the limit doubles with each consecutive start timeout
    of the tier (`consecutive`) instead of killing every start at the same
    point forever. A replica whose heartbeat still says `starting` (`beating`)
    is making progress: it is given far longer, though not for ever.
    """
    limit = (2 * max(0.0, startup_s) + 10.0) * 2 ** min(max(0, consecutive), _TIMEOUT_DOUBLINGS)
    return max(limit * BEATING_START_FACTOR, BEATING_START_MIN_S) if beating else limit


def wedged(last_beat_s: float, now: float, heartbeat_s: float) -> bool:
    """A ready replica whose heartbeat has been missing this long is wedged (or its
    process is gone without the backend noticing): stop counting it as ready.
    Three missed beats and a second, as `Replica.alive` judges a heartbeat stale,
    plus as many again: a slow Redis round trip must not kill a healthy replica."""
    return now - last_beat_s > 2 * (3 * heartbeat_s + 1)
