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


def decide_tier(s: TierState, cfg: TierConfig, now: float) -> ScaleDecision:
    """What to do with one tier now, and why: scale out, scale in by one, hold, or capped.

    `s` is what was observed (`fleet.policy.observation.scaling_state` builds it),
    `cfg` the tier's config, `now` the epoch seconds the observation was made.
    In order:

    1. demand: replicas for the arrival rate, and for the line plus what piles
       up during a start-up drained within the threshold (never counting the
       replicas already starting, so an order is never placed twice);
    2. bounds: floor = max(warm floor, pre-warm); ceiling = min(max_replicas,
       budget, GPU room), draining replicas counted against it;
    3. scale out to max(demand, floor) within the ceiling (`capped` when the
       ceiling leaves no room); otherwise
    4. scale in by one when above the floor (or the ceiling) and demand leaves a
       replica spare, only with nothing starting, an empty line (unless above
       the ceiling) and a calm of `scale_in_hold_s`; each step restarts the hold;
    5. otherwise hold, saying why.

    The decision carries `calm_since`, which the caller passes back in the next
    `TierState`.
    """
    thr = cfg.drain_threshold_s
    floor = max(cfg.warm_floor, s.prewarm_floor)
    ceiling, ceiling_by = ceiling_of(cfg.max_replicas, s.budget_ceiling, s.gpu_ceiling)
    have = s.ready + s.starting
    drain = seconds_to_drain(s.waiting, s.service_rate)
    hot = s.waiting > 0 and (drain > thr or s.oldest_wait_s > thr)

    # Demand. Desired never depends on `starting`: an order placed last tick
    # raises `have`, not the need, so the same need is never ordered twice.
    r = max(s.per_replica_rate, 1e-9)
    # Arrivals alone order replicas only for a rate clear of its Poisson noise (the count
    # over the window, less SCALE_IN_NOISE_SD deviations): a high draw is no reason to pay
    # a cold start, and a real excess shows in the line within seconds (`by_line`).
    lo = rate_with_margin(s.arrival_rate, s.rate_window_s, -SCALE_IN_NOISE_SD)
    by_arrival = replicas_for(lo, r) if lo > 0 else 0
    # The line now plus what piles up while new replicas start, drained within the threshold.
    growth = backlog_during_startup(s.arrival_rate, s.ready * r, s.startup_s)
    backlog = s.waiting + growth
    by_line = line_need(backlog, s.ready, r, thr, s.batch)
    desired = max(by_arrival, by_line)
    target = max(desired, floor)
    # What scale-in must clear: the need with a margin for Poisson noise in the rate. Calm
    # restarts at every tick where it reaches the ready replicas, so a step down needs it
    # below ready for the whole hold: the highest recommendation over the hold, as HPA's
    # scale-down stabilisation window, with noise taken off first.
    hi = rate_with_margin(s.arrival_rate, s.rate_window_s)
    keep = max(replicas_for(hi, r) if hi > 0 else 0, by_line)
    # Calm is "the drain is under its threshold and the demand leaves a replica
    # spare"; any tick that needs every ready replica restarts it. A calm
    # period carried over from before a burst must not let the first lull in
    # the burst remove a replica that the next second orders again.
    # Above the ceiling (the budget fell, or a window that is about to open
    # bounds it) the hold runs whatever the line: demand is no reason to stay
    # over a limit, and a busy line must not hold the tier there forever.
    over = have > ceiling and have > floor
    calm = over or (not hot and keep < s.ready)
    calm_since = (now if s.calm_since is None else s.calm_since) if calm else None
    calm_keep = (keep if s.calm_since is None else max(s.calm_keep, keep)) if calm else 0

    def made(action: Action, delta: int, reason: str, code: str, calm: float | None = calm_since,
             kept: int = calm_keep) -> ScaleDecision:
        return ScaleDecision(action=action, delta=delta, reason=reason, code=code, floor=floor, ceiling=ceiling,
                             ceiling_by=ceiling_by, desired=desired, drain_s=drain, calm_since=calm, calm_keep=kept)

    # Above the ceiling (the budget fell, or max_replicas was lowered): step down, by the
    # same careful rules as scale-in, however much the demand would like to keep them.
    # Draining replicas still hold their GPUs and bill until they leave: new
    # orders fit under the ceiling beside them.
    room = max(0, ceiling - s.draining)
    if target > have and not over:
        if have >= room:
            return made("capped", 0, f"capped: {ceiling_by} (ceiling {ceiling}, want {target}, have {have}"
                        + (f", {s.draining} draining" if s.draining else "") + ")", ceiling_by)
        goal = min(target, room)
        delta = goal - have
        counting = f"+{delta} counting {s.starting} starting"
        if hot and desired > have:
            if math.isinf(drain):
                why = f"drain inf s > {thr:g} s (nothing served in the rate window)"
            elif drain > thr:
                why = f"drain {drain:.1f} s > {thr:g} s"
            else:
                why = f"oldest wait {s.oldest_wait_s:.1f} s > {thr:g} s"
            reason, code = f"scale_out: {why}, {counting}", "drain"
        elif desired > have:
            if by_arrival >= by_line:
                reason = (f"scale_out: arrivals {s.arrival_rate:.1f}/s need {by_arrival} at {r:.1f}/s each, "
                          f"{counting}")
                code = "arrival"
            else:
                piling = f" + {growth:.0f} arriving during {s.startup_s:.0f} s of start-up" if growth >= 0.5 else ""
                reason = f"scale_out: line {s.waiting}{piling} needs {by_line} to drain in {thr:g} s, {counting}"
                code = "line"
        else:
            kind = "pre-warm" if s.prewarm_floor > cfg.warm_floor else "warm floor"
            reason, code = f"scale_out: floor {floor} ({kind}), {counting}", "floor"
        if goal < target:
            reason += f" (capped: {ceiling_by} at {ceiling})"
        return made("scale_out", delta, reason, code)

    if over or (have > floor and keep < s.ready):
        if s.starting:
            return made("hold", 0, f"hold: {s.starting} starting", "starting")
        # Over the ceiling a queued line does not hold the step down: the replica
        # drains (finishes what it holds), and what waits is served by the rest.
        if s.waiting and not over:
            return made("hold", 0, f"hold: line not empty ({s.waiting} waiting)", "line")
        calm_for = 0.0 if calm_since is None else now - calm_since
        if calm_for < cfg.scale_in_hold_s:
            above = f" (above the {ceiling_by} ceiling {ceiling})" if over else ""
            return made("hold", 0, f"hold: calm {calm_for:.0f} s of {cfg.scale_in_hold_s:g} s before scale-in{above}",
                        "hold_period")
        # Down to the highest need the hold saw (above the ceiling: to the ceiling, whatever
        # the demand), at least one. The step restarts the hold: the next waits a whole hold.
        goal = min(max(floor, ceiling if over else calm_keep), have - 1)
        why = (f"above the ceiling {ceiling} ({ceiling_by})" if over
               else f"need at most {calm_keep} with noise margin over the hold")
        return made("scale_in", goal - have, f"scale_in: calm {calm_for:.0f} s >= {cfg.scale_in_hold_s:g} s, "
                    f"{have} -> {goal} (floor {floor}, {why})", ceiling_by if over else "idle", calm=now, kept=keep)

    if s.starting:
        return made("hold", 0, f"hold: {s.starting} starting", "starting")
    margin = f", {keep} with noise margin" if keep > desired else ""
    return made("hold", 0, f"hold: {have} replicas (floor {floor}, ceiling {ceiling}, need {desired}{margin})",
                "steady")
