"""Calibration: what replicas measure, set against what the capacity profile expected.

Two figures, each corrected both ways (up as well as down):

- start-up: the median of the start-ups measured (launch to ready, as the
  scaler saw them), else of the engines' own cold starts, else the profile's.
  A start that timed out ran at least as long as it was given: until one is
  measured, the estimate is no shorter (the start-up floor).
- throughput: `rate_factor` = modelled service time / measured, whichever side
  of 1 it falls, measured two ways. A window in which every ready replica was
  busy the whole time (the line waited the window and a call's service more)
  measures what a replica can do directly: served per replica / modelled per
  replica (an idle replica's completions measure demand, not capacity). A
  reading slower than the factor applies at once; a faster one is smoothed
  like Little's. Outside saturation, Little's law measures the service time
  itself: calls in service (the heartbeats' in_use) / completions per second,
  set against the model's service time at the batch the replicas run. That
  second reading matters because a call's length is not a constant: the Azure
  conversation trace's answers average 270 tokens in one quarter hour and 140
  in another, so a factor measured once, in a long-answer stretch, would size
  the tier for the rest of the hour (it held 0.82 on that replay and kept 40%
  more replicas than the short answers needed). Little's readings are smoothed
  over the rate window; either way, the ready count must have held for the
  whole window, or replicas that just became ready would read as slow.
  Between readings the last factor stands: it is a calibration, not a meter.

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
from fleet.policy.tier_capacity import TierCapacity, modelled_startup_s, planning_rank, tier_capacity

RATE_FACTOR_MIN, RATE_FACTOR_MAX = 0.01, 100.0  # beyond these a window says more about itself than the engine

# Fewer completions in the window than this say too little about the service time.
MIN_LITTLE_COMPLETIONS = 20
# Little's readings are smoothed over this many rate windows: one reading rests on one sample
# of in_use and a window's completions (a replica at low load read anywhere from 0.7 to 3.1),
# while the mix of call lengths it follows changes over minutes.
LITTLE_SMOOTHING = 6.0


@dataclass(frozen=True, slots=True)
class Calibration:
    """What the measurements say so far; carried from tick to tick like `calm_since`."""

    startup_s: float  # the start-up to plan with
    rate_factor: float = 1.0
    measured_startups: int = 0  # how many start-ups the estimate rests on (0: the profile's)
    ready: int = 0  # the ready count at the last tick...
    ready_since: float | None = None  # ...and since when it has held
    measured_at: float | None = None  # when the factor was last read (None: never; the first reading stands alone)


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
    factor, measured_at = prev.rate_factor, prev.measured_at
    served = rate(obs.completions_in_window, obs.window_s)
    steady = ready > 0 and served > 0 and obs.now - ready_since >= obs.window_s
    model = tier_capacity(tc)
    # Saturated: the line has waited a whole window and one call's service more. A replica that
    # has just filled its slots completes nothing for a service time: a window read then (the
    # first of a burst of long calls read 0.55) measures the filling, not the replica.
    fill_s = model.service_s(model.typical_prompt_tokens, model.typical_output_tokens) / max(factor, RATE_FACTOR_MIN)
    saturated = steady and waiting(obs) > 0 and obs.oldest_wait_s >= obs.window_s + fill_s
    if saturated:
        # Against what a replica serves of the line's lowest class waiting: the slots kept for
        # the classes above are not its (a full replica of 12 slots keeping one runs 11 of them).
        reading = _bounded(served / ready / model.rate_of(planning_rank(obs.line)))
        # Slower than thought: at once (the safe side; admission and scaling plan with it).
        # Faster: smoothed as Little's readings are, so that a lucky window of short calls does
        # not size the tier for the rest of the hour.
        factor = reading if reading < factor else factor + _weight(obs, measured_at) * (reading - factor)
        measured_at = obs.now
    elif steady and obs.completions_in_window >= MIN_LITTLE_COMPLETIONS:
        little = littles_factor(model, obs, served)
        if little is not None:
            factor, measured_at = _bounded(factor + _weight(obs, measured_at) * (little - factor)), obs.now
    return Calibration(startup_s=startup, rate_factor=factor, measured_startups=len(obs.startups_measured),
                       ready=ready, ready_since=ready_since, measured_at=measured_at)


def _weight(obs: TierObservation, measured_at: float | None) -> float:
    """How far a smoothed reading moves the factor: the time since the last reading over
    LITTLE_SMOOTHING rate windows, at most all the way (the first reading stands alone)."""
    if measured_at is None:
        return 1.0
    return min(1.0, max(0.0, obs.now - measured_at) / (LITTLE_SMOOTHING * obs.window_s))


def _bounded(factor: float) -> float:
    return min(RATE_FACTOR_MAX, max(RATE_FACTOR_MIN, factor))


def littles_factor(model: TierCapacity, obs: TierObservation, served: float) -> float | None:
    """Modelled / measured service time, by Little's law: the calls in service on the replicas
    that serve (ready or draining) over the completions per second is the mean time a call
    spends in service; the model's is taken at the mean batch those replicas run (a smaller
    batch decodes faster). None when nothing is in service."""
    serving = [r for r in obs.replicas.members if r.state in ("ready", "draining")]
    in_service = sum(r.in_use for r in serving)
    if not serving or in_service <= 0 or served <= 0:
        return None
    batch = max(1, min(model.batch, round(in_service / len(serving))))
    return model.service_s(model.typical_prompt_tokens, model.typical_output_tokens, batch) / (in_service / served)


def calibrated_capacity(tc: TierConfig, cal: Calibration | None) -> TierCapacity:
    """The tier's capacity with a calibration on top (None: the profile as configured)."""
    if cal is None:
        return tier_capacity(tc)
    return tier_capacity(tc, startup_s=cal.startup_s, rate_factor=cal.rate_factor)
