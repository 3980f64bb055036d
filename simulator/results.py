"""What a replay leaves behind: per tier outcomes (in `TierSim`), the decision timeline, samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simulator.scenario import Scenario
from simulator.state import TierSim


@dataclass
class TimelineEntry:
    """One tier decision as the timeline records it."""

    t: float
    tier: str
    action: str
    delta: int
    reason: str
    floor: int | None = None
    ceiling: int | None = None


@dataclass
class Sample:
    t: float
    offered: float  # calls arriving per second (admitted or not), over the rate window
    arrivals: float  # calls admitted per second, over the rate window
    waiting: int
    drain_s: float
    starting: int
    ready: int
    draining: int
    spend_usd: float


@dataclass
class SimResult:
    policy: str
    scenario: Scenario
    tiers: dict[str, TierSim]
    decisions: list[TimelineEntry]
    samples: dict[str, list[Sample]]
    chains: dict[str, dict[str, int]]
    chains_by_class: dict[str, dict[str, int]]
    budget: dict[str, dict[str, Any]]
    wall_s: float = 0.0
    events: int = 0
    seed: int = 0
    ended_s: float = 0.0  # when the last accepted call ended (>= the scenario's duration)
    chain_times: list[float] | None = None  # arrival to end, of each chain completed
    key_waits: dict[str, list[float]] | None = None  # "key:<name>" -> waits in line of its completed calls
    jain: float | None = None  # Jain's index over the flows backlogged through a window (`simulator.line`)
    fairness: str | None = None  # every tier's order within a class, when the run forced one
    callers: dict[str, Any] | None = None  # what the callers' SDKs spent and got (`simulator.clients.summary`)
