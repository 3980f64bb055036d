"""The tier decision: how many replicas a tier should run, and why. Pure; no I/O, no clock.

The live scaler and the simulator both observe a tier (its line, rates,
replicas, pre-warms, budget and GPU room), build a `TierState`, and call
`decide_tier(state, cfg, now)`. What comes back is a typed `ScaleDecision` that
carries its reason, so the operator, the metrics and the replay all see the
same why. The rules (docs/architecture.md, "What the policy keeps from its sources"):

- the signal is seconds-to-drain (requests in line / served per second), with
  the oldest wait as a second signal; never utilisation;
- floor = max(warm floor, active pre-warm); ceiling = min(max_replicas, what
  the budget allows, what the GPUs can hold);
- scale-out counts replicas already starting and the backlog that piles up
  while they start, so a need is never ordered twice;
- the arrival rate orders replicas ahead of a line only while the tier falls
  behind it (serves less than clearly arrives); the line orders the rest;
- scale-in is HPA's scale-down stabilisation: only with an empty line (or
  above the ceiling, where a queued line does not keep the tier over it), only
  after the need (with its noise margin) stayed below the ready replicas for
  `scale_in_hold_s`, never while a replica of the tier is starting, it steps
  down to the highest need seen over that hold (never below the floor; above
  the ceiling, to the ceiling). Each step restarts the hold, so a raised floor
  comes down in stages and a second, smaller spike does not pay the cold-start
  tax again. One replica per hold, as the first version did, kept a planner
  tier at 6 replicas for ten minutes after a five-minute crowd that needed one.

The scaler carries two figures between ticks, `calm_since` (since when the
need has stayed below the ready replicas, or when the last step down
happened) and `calm_keep` (the highest need seen since then); they go in with
the state and come back in the decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fleet.config import TierConfig
from fleet.policy.capacity import backlog_during_startup, replicas_for, seconds_to_drain

Action = Literal["scale_out", "scale_in", "hold", "capped"]
CeilingBy = Literal["max_replicas", "budget", "gpu_memory"]

# Bounded reason codes: the `reason` label of fleet_scale_decisions_total.
# The human reason string carries the numbers; the code keeps the label set small.
REASON_CODES = ("floor", "drain", "arrival", "starting", "line", "hold_period", "idle", "steady",
                "max_replicas", "budget", "gpu_memory")


@dataclass(frozen=True, slots=True)
class TierState:
    """What the scaler observed about one tier at one instant."""

    waiting: int  # requests in the line, all classes
    oldest_wait_s: float
    arrival_rate: float  # admitted requests per second
    service_rate: float  # completed requests per second
    ready: int
    starting: int  # ordered and not yet ready, including ones that have not heartbeated yet
    per_replica_rate: float  # requests per second one ready replica serves
    startup_s: float  # expected seconds from ordering a replica to it serving
    draining: int = 0
    prewarm_floor: int = 0  # from `active_prewarm`
    budget_ceiling: int | None = None  # most replicas the budget allows; None: no limit
    gpu_ceiling: int | None = None  # most replicas the GPUs can hold; None: no GPU limit
    calm_since: float | None = None  # carried by the scaler: see the module doc
    calm_keep: int = 0  # carried by the scaler: the highest need seen since calm_since
    rate_window_s: float = 0.0  # the window the arrival rate was counted over (its Poisson noise); 0: none
    batch: int = 0  # calls a replica that joins takes from the line at once (its free slots); 0: not counted


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """What to do with a tier now, and why."""

    action: Action
    delta: int  # replicas to add (> 0) or remove (< 0); 0 for hold and capped
    reason: str  # e.g. "scale_out: drain 4.1 s > 2 s, +4 counting 0 starting"
    code: str  # one of REASON_CODES, for metrics
    floor: int
    ceiling: int
    ceiling_by: CeilingBy
    desired: int  # replicas the demand alone asks for
    drain_s: float
    calm_since: float | None  # carry into the next TierState
    calm_keep: int = 0  # carry into the next TierState


def ceiling_of(max_replicas: int, budget_ceiling: int | None, gpu_ceiling: int | None) -> tuple[int, CeilingBy]:
    """The smallest of the three limits, and which one binds (budget first on a tie:
    it is the limit an operator most needs to hear about)."""
    limits: list[tuple[int, CeilingBy]] = [(max_replicas, "max_replicas")]
    if gpu_ceiling is not None:
        limits.append((max(0, gpu_ceiling), "gpu_memory"))
    if budget_ceiling is not None:
        limits.append((max(0, budget_ceiling), "budget"))
    low = min(n for n, _ in limits)
    order: dict[CeilingBy, int] = {"budget": 0, "gpu_memory": 1, "max_replicas": 2}
    return low, min((by for n, by in limits if n == low), key=order.__getitem__)


def gpu_ceiling(have: int, draining: int, room: int | None) -> int | None:
    """The most replicas the GPUs can hold: every replica holding GPUs (ready, starting,
    and draining until it leaves) plus the room left. `decide_tier` takes the draining
    ones off the ceiling itself, so they belong in it. None: no GPU limit."""
    return None if room is None else have + draining + room


def budget_ceiling_for(published: int | None, judged: bool, has_budget: bool, have: int) -> int | None:
    """The budget ceiling to decide with (the fail-safe when the budget is unknown).

    A fresh judgement: its ceiling (None: the budget does not bound). No fresh
    judgement (the governor is failing and its judgement expired) for a tier with
    a budget must not mean "unbounded": the tier may keep what it has, but not
    grow, until the governor answers again. A tier without a budget is not bounded.
    """
    if judged:
        return None if published is None else max(0, int(published))
    return have if has_budget else None


# How many standard deviations of Poisson noise the arrival rate must stay clear of before
# a replica is given back: a rate counted over a 10 s window wanders by sqrt(rate / 10);
# scaling in on a low draw only to scale out on the next high one is a flap (a cold start).
SCALE_IN_NOISE_SD = 2.0


def rate_with_margin(arrival_rate: float, window_s: float, sd: float = SCALE_IN_NOISE_SD) -> float:
    """The arrival rate plus `sd` standard deviations of the noise of a Poisson count over
    `window_s` (the rate itself when no window is known)."""
    if arrival_rate <= 0 or window_s <= 0:
        return max(0.0, arrival_rate)
    return max(0.0, arrival_rate + sd * math.sqrt(arrival_rate / window_s))


def line_need(backlog: float, ready: int, per_replica_rate: float, threshold_s: float, batch: int = 0) -> int:
    """Replicas that serve `backlog` waiting calls within `threshold_s`, `ready` of them busy now.

    The busy replicas free a slot `per_replica_rate` times a second each. A replica
    that joins has `batch` free slots: it takes that many calls from the line the
    moment it is ready, then frees slots like the rest. So n replicas drain the line
    in time when backlog - (n - ready) x batch <= threshold x n x rate. Without the
    batch (0), the line drains at the completion rate alone, which on a tier of long
    calls orders several times what it needs: a planner of 8 slots and 11 s calls
    frees 1.4 calls in a 2 s threshold, but a new replica takes 8 at once.
    """
    if backlog <= 0:
        return 0
    r = max(per_replica_rate, 1e-9)
    need = backlog / (threshold_s * r)
    if need > ready and batch > 0:
        need = (backlog + ready * batch) / (batch + threshold_s * r)
    return math.ceil(need)


@dataclass(frozen=True, slots=True)
class Demand:
    """What the load asks of a tier, in replicas. Never counts the replicas starting: an
    order placed last tick raises what the tier has, not the need, so a need is never
    ordered twice."""

    per_replica_rate: float  # what one ready replica serves (kept off zero: it divides)
    by_arrival: int  # for the arrival rate clear of its Poisson noise
    by_line: int  # for the line plus what piles up during a start-up, drained within the threshold
    piling: float  # the calls that arrive during a start-up
    desired: int  # the larger of the two
    with_margin: int  # the need with a margin for noise: what a scale-in must stay clear of
    drain_s: float  # the line's seconds to drain at the service rate
    hot: bool  # the line waits longer than the threshold (its drain or its oldest wait)


def tier_demand(state: TierState, cfg: TierConfig) -> Demand:
    """Step 1 of `decide_tier`: replicas for the arrivals and for the line."""
    threshold = cfg.drain_threshold_s
    drain = seconds_to_drain(state.waiting, state.service_rate)
    hot = state.waiting > 0 and (drain > threshold or state.oldest_wait_s > threshold)
    per_replica = max(state.per_replica_rate, 1e-9)
    # Arrivals alone order replicas only for a rate clear of its Poisson noise (the count
    # over the window, less SCALE_IN_NOISE_SD deviations): a high draw is no reason to pay
    # a cold start, and a real excess shows in the line within seconds (`by_line`).
    low_rate = rate_with_margin(state.arrival_rate, state.rate_window_s, -SCALE_IN_NOISE_SD)
    # And only while the tier falls behind them: it serves less than clearly arrives. A tier
    # that keeps up has what the arrivals need, whatever the modelled rate says: on long
    # prompts, where a call's length swings the model's rate, and on bursts the slots absorb,
    # a rate order bought replicas the line never asked for.
    behind = low_rate > state.service_rate
    by_arrival = replicas_for(low_rate, per_replica) if low_rate > 0 and behind else 0
    # The line now plus what piles up while new replicas start, drained within the threshold.
    piling = backlog_during_startup(state.arrival_rate, state.ready * per_replica, state.startup_s)
    by_line = line_need(state.waiting + piling, state.ready, per_replica, threshold, state.batch)
    # What scale-in must clear: the need with a margin for Poisson noise in the rate. Calm
    # restarts at every tick where it reaches the ready replicas, so a step down needs it
    # below ready for the whole hold: the highest recommendation over the hold, as HPA's
    # scale-down stabilisation window, with noise taken off first.
    # The margin is the noise of a count over the hold, not over the rate window: the hold
    # already keeps the highest need it saw, tick after tick, so a window's margin on top of
    # that counted the noise twice (on 5.4/s of long calls it held two replicas spare). Not on
    # a tier with budget windows: their least-spend projection was made with the wider margin,
    # and with the narrower one the market-open planner spent $80.06 of its $80 open window.
    noise_s = state.rate_window_s
    if state.rate_window_s > 0 and not cfg.budget.windows:
        noise_s = max(state.rate_window_s, cfg.scale_in_hold_s)
    high_rate = rate_with_margin(state.arrival_rate, noise_s)
    with_margin = max(replicas_for(high_rate, per_replica) if high_rate > 0 else 0, by_line)
    return Demand(per_replica, by_arrival, by_line, piling, max(by_arrival, by_line), with_margin, drain, hot)


@dataclass(frozen=True, slots=True)
class Bounds:
    """The floor and the ceiling a tier's replica count keeps between."""

    floor: int  # max(warm floor, pre-warm)
    ceiling: int  # min(max_replicas, budget, GPU room)
    ceiling_by: CeilingBy
    have: int  # ready and starting
    room: int  # the ceiling less the draining replicas (they hold GPUs and bill until they leave)
    over: bool  # above the ceiling (and the floor): step down whatever the demand


def tier_bounds(state: TierState, cfg: TierConfig) -> Bounds:
    """Step 2 of `decide_tier`: the floor, the ceiling and which limit binds."""
    floor = max(cfg.warm_floor, state.prewarm_floor)
    ceiling, ceiling_by = ceiling_of(cfg.max_replicas, state.budget_ceiling, state.gpu_ceiling)
    have = state.ready + state.starting
    # Above the ceiling (the budget fell, or max_replicas was lowered): step down, by the
    # same careful rules as scale-in, however much the demand would like to keep them.
    return Bounds(floor, ceiling, ceiling_by, have, max(0, ceiling - state.draining),
                  over=have > ceiling and have > floor)


def tier_calm(state: TierState, demand: Demand, bounds: Bounds, now: float) -> tuple[float | None, int]:
    """Step 3 of `decide_tier`: the calm carried on (`calm_since`, `calm_keep`).

    Calm is "the drain is under its threshold and the demand leaves a replica
    spare"; any tick that needs every ready replica restarts it. A calm period
    carried over from before a burst must not let the first lull in the burst
    remove a replica that the next second orders again. Above the ceiling (the
    budget fell, or a window that is about to open bounds it) the hold runs
    whatever the line: demand is no reason to stay over a limit, and a busy line
    must not hold the tier there forever.
    """
    if not (bounds.over or (not demand.hot and demand.with_margin < state.ready)):
        return None, 0
    if state.calm_since is None:
        return now, demand.with_margin
    return state.calm_since, max(state.calm_keep, demand.with_margin)


@dataclass(frozen=True, slots=True)
class _Step:
    """A branch's verdict, in numbers; `_reason` words it."""

    action: Action
    code: str
    delta: int = 0
    goal: int = 0  # replicas after the step
    target: int = 0  # what a scale-out wanted, before the ceiling
    calm_for_s: float = 0.0
    need_kept: int = 0  # the highest need over the hold a scale-in steps down to


def _scale_out(state: TierState, demand: Demand, bounds: Bounds, target: int) -> _Step:
    """Up to max(demand, floor) within the room under the ceiling; `capped` when none is left."""
    have = bounds.have
    if have >= bounds.room:
        return _Step("capped", bounds.ceiling_by, target=target)
    goal = min(target, bounds.room)
    if demand.desired > have:
        code = "drain" if demand.hot else "arrival" if demand.by_arrival >= demand.by_line else "line"
    else:
        code = "floor"
    return _Step("scale_out", code, goal - have, goal, target)


def _scale_in(state: TierState, cfg: TierConfig, bounds: Bounds, calm: tuple[float | None, int],
              now: float) -> _Step:
    """Down to the highest need the hold saw (above the ceiling: to the ceiling, whatever the
    demand), at least one, once nothing starts, the line is empty and the calm lasted the hold."""
    if state.starting:
        return _Step("hold", "starting")
    # Over the ceiling a queued line does not hold the step down: the replica
    # drains (finishes what it holds), and what waits is served by the rest.
    if state.waiting and not bounds.over:
        return _Step("hold", "line")
    calm_since, calm_keep = calm
    calm_for = 0.0 if calm_since is None else now - calm_since
    if calm_for < cfg.scale_in_hold_s:
        return _Step("hold", "hold_period", calm_for_s=calm_for)
    # The highest need the hold saw may be every replica there is: a calm carried in from more
    # replicas (one died since, or was drained) says nothing smaller is enough.
    if not bounds.over and calm_keep >= bounds.have:
        return _Step("hold", "need_kept", calm_for_s=calm_for, need_kept=calm_keep)
    goal = min(max(bounds.floor, bounds.ceiling if bounds.over else calm_keep), bounds.have - 1)
    return _Step("scale_in", bounds.ceiling_by if bounds.over else "idle", goal - bounds.have, goal,
                 calm_for_s=calm_for, need_kept=calm_keep)


def _why_out(step: _Step, state: TierState, cfg: TierConfig, demand: Demand, bounds: Bounds) -> str:
    threshold = cfg.drain_threshold_s
    if step.code == "drain":
        if math.isinf(demand.drain_s):
            return f"drain inf s > {threshold:g} s (nothing served in the rate window)"
        if demand.drain_s > threshold:
            return f"drain {demand.drain_s:.1f} s > {threshold:g} s"
        return f"oldest wait {state.oldest_wait_s:.1f} s > {threshold:g} s"
    if step.code == "arrival":
        return (f"arrivals {state.arrival_rate:.1f}/s need {demand.by_arrival} at "
                f"{demand.per_replica_rate:.1f}/s each")
    if step.code == "line":
        piling = (f" + {demand.piling:.0f} arriving during {state.startup_s:.0f} s of start-up"
                  if demand.piling >= 0.5 else "")
        return f"line {state.waiting}{piling} needs {demand.by_line} to drain in {threshold:g} s"
    kind = "pre-warm" if state.prewarm_floor > cfg.warm_floor else "warm floor"
    return f"floor {bounds.floor} ({kind})"


def _reason(step: _Step, state: TierState, cfg: TierConfig, demand: Demand, bounds: Bounds) -> str:
    """The decision in words, from its numbers: the one place a reason is written."""
    if step.action == "capped":
        draining = f", {state.draining} draining" if state.draining else ""
        return (f"capped: {bounds.ceiling_by} (ceiling {bounds.ceiling}, want {step.target}, "
                f"have {bounds.have}{draining})")
    if step.action == "scale_out":
        capped = f" (capped: {bounds.ceiling_by} at {bounds.ceiling})" if step.goal < step.target else ""
        return (f"scale_out: {_why_out(step, state, cfg, demand, bounds)}, "
                f"+{step.delta} counting {state.starting} starting{capped}")
    if step.action == "scale_in":
        why = (f"above the ceiling {bounds.ceiling} ({bounds.ceiling_by})" if bounds.over
               else f"need at most {step.need_kept} with noise margin over the hold")
        return (f"scale_in: calm {step.calm_for_s:.0f} s >= {cfg.scale_in_hold_s:g} s, "
                f"{bounds.have} -> {step.goal} (floor {bounds.floor}, {why})")
    if step.code == "starting":
        return f"hold: {state.starting} starting"
    if step.code == "line":
        return f"hold: line not empty ({state.waiting} waiting)"
    if step.code == "need_kept":
        return f"hold: the hold saw a need of {step.need_kept} (have {bounds.have})"
    if step.code == "hold_period":
        above = f" (above the {bounds.ceiling_by} ceiling {bounds.ceiling})" if bounds.over else ""
        return f"hold: calm {step.calm_for_s:.0f} s of {cfg.scale_in_hold_s:g} s before scale-in{above}"
    margin = f", {demand.with_margin} with noise margin" if demand.with_margin > demand.desired else ""
    return (f"hold: {bounds.have} replicas (floor {bounds.floor}, ceiling {bounds.ceiling}, "
            f"need {demand.desired}{margin})")


def decide_tier(state: TierState, cfg: TierConfig, now: float) -> ScaleDecision:
    """What to do with one tier now, and why: scale out, scale in, hold, or capped.

    `state` is what was observed (`fleet.policy.observation.scaling_state` builds it),
    `cfg` the tier's config, `now` the epoch seconds the observation was made.
    In order:

    1. demand (`tier_demand`): replicas for the arrival rate, and for the line
       plus what piles up during a start-up drained within the threshold (never
       counting the replicas already starting, so an order is never placed twice);
    2. bounds (`tier_bounds`): floor = max(warm floor, pre-warm); ceiling =
       min(max_replicas, budget, GPU room), draining replicas counted against it;
    3. calm (`tier_calm`): since when the demand has left a replica spare;
    4. scale out to max(demand, floor) within the ceiling (`capped` when the
       ceiling leaves no room); otherwise
    5. scale in when above the floor (or the ceiling) and demand leaves a
       replica spare, only with nothing starting, an empty line (unless above
       the ceiling) and a calm of `scale_in_hold_s`; each step restarts the hold;
    6. otherwise hold, saying why. The reason is worded by `_reason` alone.

    The decision carries `calm_since`, which the caller passes back in the next
    `TierState`.
    """
    demand = tier_demand(state, cfg)
    bounds = tier_bounds(state, cfg)
    calm_since, calm_keep = tier_calm(state, demand, bounds, now)
    target = max(demand.desired, bounds.floor)
    if target > bounds.have and not bounds.over:
        step = _scale_out(state, demand, bounds, target)
    elif bounds.over or (bounds.have > bounds.floor and demand.with_margin < state.ready):
        step = _scale_in(state, cfg, bounds, (calm_since, calm_keep), now)
    else:
        step = _Step("hold", "starting" if state.starting else "steady")
    if step.action == "scale_in":  # the step restarts the hold: the next waits a whole hold
        calm_since, calm_keep = now, demand.with_margin
    return ScaleDecision(action=step.action, delta=step.delta, reason=_reason(step, state, cfg, demand, bounds),
                         code=step.code, floor=bounds.floor, ceiling=bounds.ceiling, ceiling_by=bounds.ceiling_by,
                         desired=demand.desired, drain_s=demand.drain_s, calm_since=calm_since, calm_keep=calm_keep)
