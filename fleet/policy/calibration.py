"""Calibration: what replicas measure, set against what the capacity profile expected.

Two figures, each corrected both ways (up as well as down):

- start-up: the median of the start-ups measured (launch to ready, as the
  scaler saw them), else of the engines' own cold starts, else the profile's.
  A start that timed out ran at least as long as it was given: until one is
  measured, the estimate is no shorter (the start-up floor).
- throughput: only a window in which every ready replica was busy the whole
  time measures what a replica can do (an idle replica's completions measure
  demand). Such a window sets `rate_factor` = served per replica / modelled per
  replica, whichever side of 1 it falls. The ready count must have held for the
  whole window, or replicas that just became ready would read as slow.
  Between such windows the last factor stands: it is a calibration, not a meter.

The scaler calibrates each tick and publishes the result (`fleet.store.capacity`);
the gateways plan admission with it; the simulator calibrates the same way.
Pure; no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from fleet.config import TierConfig
from fleet.policy.capacity import rate
from fleet.policy.observation import TierObservation, waiting
from fleet.policy.tier_capacity import TierCapacity, modelled_startup_s, tier_capacity

RATE_FACTOR_MIN, RATE_FACTOR_MAX = 0.01, 100.0  # beyond these a window says more about itself than the engine


@dataclass(frozen=True, slots=True)
class Calibration:
    """What the measurements say so far; carried from tick to tick like `calm_since`."""

    startup_s: float  # the start-up to plan with
    rate_factor: float = 1.0
    measured_startups: int = 0  # how many start-ups the estimate rests on (0: the profile's)
    ready: int = 0  # the ready count at the last tick...
    ready_since: float | None = None  # ...and since when it has held


def startup_estimate(measured: Sequence[float], engine_cold_starts: Sequence[float], modelled_s: float,
                     at_least_s: float = 0.0) -> float:
    """Seconds a new replica takes to serve: the median of the start-ups measured (launch to
    ready), else of the engines' own cold starts, else the model, and never less than
    `at_least_s` (a start that timed out) until one is measured."""
    seen = [s for s in measured if s is not None and s >= 0] or \
        [s for s in engine_cold_starts if s is not None and s >= 0]
    if seen:
        return statistics.median(seen)
    return max(max(0.0, modelled_s), at_least_s)


def initial_calibration(tc: TierConfig) -> Calibration:
    return Calibration(startup_s=modelled_startup_s(tc))


def calibrate(prev: Calibration, tc: TierConfig, obs: TierObservation, *, at_least_s: float = 0.0) -> Calibration:
    """The calibration after this observation (see the module doc). `at_least_s`: the longest
    start that timed out, a floor on the start-up until one is measured."""
    ready = obs.replicas.ready
    ready_since = prev.ready_since if ready == prev.ready and prev.ready_since is not None else obs.now
    engine = [r.cold_start_s for r in obs.replicas.members if r.cold_start_s is not None]
    startup = startup_estimate(obs.startups_measured, engine, modelled_startup_s(tc), at_least_s)
    factor = prev.rate_factor
    served = rate(obs.completions_in_window, obs.window_s)
    saturated = (waiting(obs) > 0 and ready > 0 and served > 0 and obs.oldest_wait_s >= obs.window_s
                 and obs.now - ready_since >= obs.window_s)
    if saturated:
        modelled = tier_capacity(tc).per_replica_rate
        factor = min(RATE_FACTOR_MAX, max(RATE_FACTOR_MIN, served / ready / modelled))
    return Calibration(startup_s=startup, rate_factor=factor, measured_startups=len(obs.startups_measured),
                       ready=ready, ready_since=ready_since)


def calibrated_capacity(tc: TierConfig, cal: Calibration | None) -> TierCapacity:
    """The tier's capacity with a calibration on top (None: the profile as configured)."""
    if cal is None:
        return tier_capacity(tc)
    return tier_capacity(tc, startup_s=cal.startup_s, rate_factor=cal.rate_factor)
