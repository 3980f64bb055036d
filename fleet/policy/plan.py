"""One tier's tick, whole: `plan_tier(input, state) -> plan`. Pure; no I/O, no clock.

The live scaler and the simulator are adapters around this one function. Each
fills a `PlanInput` (what it observed of the tier, the operator's pre-warm
orders, the GPU room it knows of), keeps one `PlanState` per tier between
ticks, and carries out the `TierPlan` that comes back (starts, drains, what it
publishes). The steps, in order, are the ones both used to compose by hand:

    calibrate -> capacity -> pre-warm floor -> ceilings (budget, GPUs)
    -> scaling state -> `decide_tier` -> carry calm and calibration

so the replay cannot drift from the live loop by omitting one (the simulator
used to pass no GPU ceiling and no orders, silently; now it says what it has).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from fleet.config import TierConfig
from fleet.policy.calibration import Calibration, calibrate, calibrated_capacity, initial_calibration
from fleet.policy.observation import TierObservation, scaling_state
from fleet.policy.prewarm import (
    ColdStart,
    Prewarm,
    PrewarmOrder,
    active_prewarm,
    planning_cold_start,
    prewarm_lead_s,
    ready_lead_s,
)
from fleet.policy.scaling import ScaleDecision, budget_ceiling_for, decide_tier, gpu_ceiling
from fleet.policy.tier_budget import tier_has_budget
from fleet.policy.tier_capacity import TierCapacity, modelled_startup_s

STARTUPS_KEPT = 5  # start-ups remembered per tier; their median is the expected start-up


@dataclass(frozen=True, slots=True)
class PlanState:
    """What one tier's tick carries to the next: the calibration, the calm (see
    `fleet.policy.scaling`) and the start-ups measured from launch to ready."""

    calibration: Calibration | None = None  # None: not calibrated yet (the profile's figures)
    calm_since: float | None = None
    calm_keep: int = 0
    startups: tuple[float, ...] = ()  # launch to ready, newest last, at most STARTUPS_KEPT
    startup_at_least_s: float = 0.0  # the longest start that timed out: a floor until one is measured


@dataclass(frozen=True, slots=True)
class PlanInput:
    """What the adapter observed for one tick of one tier."""

    obs: TierObservation
    cfg: TierConfig
    tick_s: float  # how often the tier is ticked (a pre-warm starts one start-up and a tick early)
    orders: Sequence[PrewarmOrder]  # the operator's pre-warm orders (`fleet prewarm`); () when none
    gpu_room: int | None  # more replicas of this tier the free GPUs hold; None: no GPU limit


@dataclass(frozen=True, slots=True)
class TierPlan:
    """What to do with the tier now, with what it was decided on, and the state to carry."""

    decision: ScaleDecision
    calibration: Calibration  # to publish for the gateways' admission
    capacity: TierCapacity  # the calibrated capacity the decision used
    prewarm: Prewarm  # the pre-warm in force
    state: PlanState  # pass to the next tick
    ready_cold: ColdStart  # what a `ready_at` window plans with now: published, so status shows the same plan


def with_startup(state: PlanState, startup_s: float) -> PlanState:
    """The state after a replica was measured starting in `startup_s` (launch to ready)."""
    return replace(state, startups=(*state.startups, startup_s)[-STARTUPS_KEPT:])


def with_start_timeout(state: PlanState, ran_s: float) -> PlanState:
    """The state after a start timed out having run `ran_s`: the start-up is at least that."""
    return replace(state, startup_at_least_s=max(state.startup_at_least_s, ran_s))


def _ready_cold(inp: PlanInput, state: PlanState) -> ColdStart:
    """The cold start a `ready_at` window plans with: the p95 measured (`fleet.policy.prewarm`)."""
    obs = inp.obs
    return planning_cold_start(obs.startups_measured,
                               [r.cold_start_s for r in obs.replicas.members if r.cold_start_s is not None],
                               modelled_startup_s(inp.cfg), state.startup_at_least_s)


def plan_tier(inp: PlanInput, state: PlanState) -> TierPlan:
    """One tick of one tier: calibrate on what replicas measured, take the pre-warm floor and
    the ceilings (budget with its fail-safe, GPU room), decide, and carry calm and calibration."""
    obs, tc = inp.obs, inp.cfg
    cal = calibrate(state.calibration or initial_calibration(tc), tc, obs, at_least_s=state.startup_at_least_s)
    cap = calibrated_capacity(tc, cal)
    ready_cold = _ready_cold(inp, state)
    ready_lead = ready_lead_s(ready_cold, inp.tick_s) if tc.prewarm else None
    prewarm = active_prewarm(tc.prewarm, inp.orders, obs.now, prewarm_lead_s(cap.startup_s, inp.tick_s),
                             tc.budget.timezone, ready_lead=ready_lead)
    reps = obs.replicas
    have = reps.ready + reps.starting
    budget = obs.budget
    # The draining replicas still hold GPUs: they are in the GPU ceiling, and
    # `decide_tier` takes them off it itself.
    scaling = scaling_state(
        obs, cap, prewarm_floor=prewarm.floor,
        budget_ceiling=budget_ceiling_for(budget.ceiling if budget else None, budget is not None,
                                          tier_has_budget(tc), have),
        gpu_ceiling=gpu_ceiling(have, reps.draining, inp.gpu_room),
        calm_since=state.calm_since, calm_keep=state.calm_keep)
    decision = decide_tier(scaling, tc, obs.now)
    carried = replace(state, calibration=cal, calm_since=decision.calm_since, calm_keep=decision.calm_keep)
    return TierPlan(decision, cal, cap, prewarm, carried, ready_cold)
