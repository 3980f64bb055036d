"""What a part observes of one tier, and the pure builders that turn it into policy inputs.

`TierObservation` is the one shape: the line by class, in flight, the oldest
wait, arrivals and completions over the rate window (and within the busy
spell), the replicas by state with their slots (and their engines' measured
start-ups), the start-ups measured from launch to ready, and the budget
judgement.
The live readers build it from Redis (`fleet.observe`, the gateway's
admission), the simulator from its own state, all through `observe_tier`
(the one builder: what a reader leaves out is zero, and the busy spell is
never longer than the window); then everyone derives rates,
drain time, the admission forecast and the scaling state here, and nowhere
else. Pure; no I/O, no clock: `now` is in the observation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleet.config import Priority, TierConfig
from fleet.policy.admission import (
    AdmissionDecision,
    ServiceForecast,
    admit,
    service_forecast,
    wait_with_ceiling_s,
)
from fleet.policy.capacity import rate, seconds_to_drain
from fleet.policy.replicas import NO_REPLICAS, ObservedReplica, Replicas
from fleet.policy.scaling import TierState
from fleet.policy.tier_budget import BudgetView
from fleet.policy.tier_capacity import TierCapacity, planning_rank


@dataclass(frozen=True, slots=True)
class BudgetSignal:
    """The budget governor's judgement, as the policy reads it."""

    exhausted: bool = False
    retry_at: float | None = None  # epoch seconds the binding window ends, when exhausted
    ceiling: int | None = None  # the most replicas the budget allows; None: it does not bound


@dataclass(frozen=True, slots=True)
class TierObservation:
    """One tier at one instant (`now`, epoch seconds)."""

    tier: str
    now: float
    window_s: float  # the rate window the counts below are over
    line: tuple[int, int, int, int] = (0, 0, 0, 0)  # waiting by class, highest first (and being admitted)
    oldest_wait_s: float = 0.0
    in_flight: int = 0
    arrivals_in_window: int = 0  # admitted
    completions_in_window: int = 0
    busy_s: float = 0.0  # how long the line has been non-empty, at most the window
    completions_while_busy: int = 0
    replicas: Replicas = NO_REPLICAS
    startups_measured: tuple[float, ...] = ()  # launch to ready, as the supervisor measured it (newest last)
    budget: BudgetSignal | None = None  # None: no judgement published (not judged)


def budget_signal(view: BudgetView | None) -> BudgetSignal | None:
    """The governor's judgement as the policy reads it (None: none published, not judged)."""
    return None if view is None else BudgetSignal(view.exhausted, view.retry_at, view.ceiling)


def observe_tier(tier: str, now: float, window_s: float, *, line: Sequence[int] = (0, 0, 0, 0),
                 oldest_wait_s: float = 0.0, in_flight: int = 0, arrivals_in_window: int = 0,
                 completions_in_window: int = 0, busy_s: float = 0.0, completions_while_busy: int = 0,
                 replicas: Replicas | Iterable[ObservedReplica] = NO_REPLICAS,
                 startups_measured: Iterable[float] = (), budget: BudgetSignal | None = None) -> TierObservation:
    """The one builder of a `TierObservation`, for every reader (Redis, the gateway's one
    round trip, the replay): counts a reader has no figure for are zero, the busy spell is
    cut to the window, and the replicas are counted by state once."""
    by_class = tuple(line)
    if len(by_class) != 4:
        raise ValueError(f"the line has four classes, got {len(by_class)}")
    return TierObservation(
        tier=tier, now=now, window_s=window_s, line=by_class,
        oldest_wait_s=oldest_wait_s, in_flight=in_flight, arrivals_in_window=arrivals_in_window,
        completions_in_window=completions_in_window, busy_s=min(max(0.0, busy_s), window_s),
        completions_while_busy=completions_while_busy,
        replicas=replicas if isinstance(replicas, Replicas) else Replicas.of(replicas),
        startups_measured=tuple(startups_measured), budget=budget)


# --- meters ------------------------------------------------------------------------------


def waiting(obs: TierObservation) -> int:
    return sum(obs.line)


def ahead_of(obs: TierObservation, priority: Priority) -> int:
    """Requests a new arrival of this class would wait behind: its class and every higher one."""
    return sum(obs.line[: priority + 1])


def arrival_rate(obs: TierObservation) -> float:
    """Admitted requests per second over the rate window."""
    return rate(obs.arrivals_in_window, obs.window_s)


def service_rate(obs: TierObservation) -> float:
    """Completed requests per second over the rate window."""
    return rate(obs.completions_in_window, obs.window_s)


def drain_s(obs: TierObservation) -> float:
    """The scaling signal: seconds to drain the line at the service rate (inf when nothing serves it)."""
    return seconds_to_drain(waiting(obs), service_rate(obs))


# --- admission -----------------------------------------------------------------------------


def admission_forecast(obs: TierObservation, cap: TierCapacity, rank: int | None = None) -> ServiceForecast:
    """How fast the tier will serve a new arrival's line, and after how long (see
    `fleet.policy.admission.service_forecast`), for a call of class `rank` (None: the line's
    `planning_rank`): on the slots that class may take. A starting replica serves when its
    expected start-up has passed since it was launched."""
    reps = obs.replicas
    rank = planning_rank(obs.line) if rank is None else rank
    starting_left = ([r.started + cap.startup_s - obs.now for r in reps.members if r.state == "starting"]
                     if not reps.ready and reps.starting else [])
    # Slots the ready replicas run nothing in: their slots (no more than their KV cache holds at
    # the typical shape), less those kept for the classes above this one, less what the line has
    # in flight now.
    kept = cap.batch - cap.batch_of(rank)
    # A plain loop, not a generator: admission runs this for every arrival (same sum of ints).
    batch, ready_slots = cap.batch, 0
    for r in reps.members:
        if r.state == "ready":
            free = (r.slots if r.slots < batch else batch) - kept
            if free > 0:
                ready_slots += free
    return service_forecast(
        ready=reps.ready, starting_left_s=starting_left, per_replica_rate=cap.rate_of(rank),
        startup_s=cap.startup_s, completions_in_window=obs.completions_in_window, window_s=obs.window_s,
        busy_s=obs.busy_s, completions_while_busy=obs.completions_while_busy,
        free_slots=ready_slots - obs.in_flight)


@dataclass(frozen=True, slots=True)
class AdmissionInput:
    """One call's admission question: what was observed of its tier, and what the call asks.
    The gateway and the simulator each fill one per call (`for_tier`) and ask `judge_admission`."""

    obs: TierObservation
    capacity: TierCapacity  # as the scaler last calibrated it
    priority: Priority
    prompt_tokens: int
    # The length admission assumes, never the call's true one (`TierCapacity.output_estimate`):
    # the gateway cannot know it, nor may the simulator.
    output_tokens: int
    wait_limit_s: float  # the longest this class may be predicted to wait
    deadline_s: float | None
    max_replicas: int | None = None  # the tier's ceiling before the budget's; None: unbounded
    # The deadline bounds its first token, not its last (a stream on its SDK's read timeout,
    # `fleet.policy.client_clock`).
    first_token: bool = False
    # What the caller waits across its retries, which join the call (`fleet.policy.client_clock`):
    # the bound for a call whose own service alone does not fit `deadline_s`. None: no such bound.
    patience_s: float | None = None
    # The first call of a chain with no call served or open: when a class must be shed, new chains
    # go before chains under way (the work spent on a chain is not thrown away for one not begun).
    opens_chain: bool = False
    # In a fair tier: every call of its class and higher waiting now, not only those the fair order
    # puts before it. Its deadline is judged on these: calls that arrive later may still be put
    # before it, but never more than the line holds while admission keeps it within the deadline.
    class_ahead: int | None = None

    @classmethod
    def for_tier(cls, obs: TierObservation, capacity: TierCapacity, tc: TierConfig, priority: Priority, *,
                 prompt_tokens: int, output_tokens: int, deadline_s: float | None,
                 first_token: bool = False, patience_s: float | None = None,
                 opens_chain: bool = False, class_ahead: int | None = None) -> AdmissionInput:
        """The question for a call on a tier configured as `tc` (its wait limit, its ceiling)."""
        return cls(obs, capacity, priority, prompt_tokens, output_tokens, tc.wait_limit(priority), deadline_s,
                   tc.max_replicas, first_token, patience_s, opens_chain, class_ahead)


# What a call that opens a new chain may wait, as a share of what a call of a chain under way may:
# the line's last room goes to chains already begun, so new chains are shed first.
NEW_CHAIN_SHARE = 0.5


def judge_admission(q: AdmissionInput) -> AdmissionDecision:
    """Admit or refuse one call on what was observed (`fleet.policy.admission.admit`).

    A committed call is judged as if the tier's ceiling (the smaller of `max_replicas`
    and the budget's ceiling; None for both: unbounded) were ordered now.
    """
    obs, cap, priority = q.obs, q.capacity, q.priority
    b = obs.budget
    exhausted = b is not None and b.exhausted
    retry_in = b.retry_at - obs.now if exhausted and b is not None and b.retry_at else None
    ahead = ahead_of(obs, priority)
    deadline_ahead = None if q.class_ahead is None else max(ahead, q.class_ahead)
    forecast = admission_forecast(obs, cap, priority)  # on the slots its class may take
    committed_wait = None
    if priority == Priority.committed:
        reps = obs.replicas
        limits = [n for n in (q.max_replicas, b.ceiling if b is not None else None) if n is not None]
        waiting_ahead = ahead if deadline_ahead is None else deadline_ahead
        committed_wait = wait_with_ceiling_s(waiting_ahead, forecast, counted=reps.ready or max(1, reps.starting),
                                             ceiling=min(limits) if limits else None,
                                             per_replica_rate=cap.rate_of(priority), startup_s=cap.startup_s)
    # A first token is its prefill and one step; the whole answer, every step.
    service_s = cap.service_s(q.prompt_tokens, 1 if q.first_token else q.output_tokens)
    deadline_s, wait_limit_s = q.deadline_s, q.wait_limit_s
    if q.patience_s is not None and deadline_s is not None and service_s > deadline_s:
        deadline_s = q.patience_s  # no attempt alone can see it: its retries will, joining it
    if q.opens_chain:  # a new chain may wait only a share of what a chain under way may
        wait_limit_s *= NEW_CHAIN_SHARE
        if deadline_s is not None and deadline_s > service_s:
            deadline_s = service_s + (deadline_s - service_s) * NEW_CHAIN_SHARE
    return admit(priority, ahead=ahead, forecast=forecast, service_s=service_s, wait_limit_s=wait_limit_s,
                 deadline_s=deadline_s, budget_exhausted=exhausted, budget_retry_in_s=retry_in,
                 committed_wait_s=committed_wait, deadline_ahead=deadline_ahead)


# --- scaling --------------------------------------------------------------------------------


def scaling_state(obs: TierObservation, cap: TierCapacity, *, prewarm_floor: int = 0, budget_ceiling: int | None,
                  gpu_ceiling: int | None = None, calm_since: float | None, calm_keep: int = 0) -> TierState:
    """The `TierState` `decide_tier` judges, from an observation and the (calibrated) capacity.
    `budget_ceiling`: see `fleet.policy.scaling.budget_ceiling_for`. A replica's rate and batch
    are those of the line's `planning_rank`: the slots kept for the classes above it are no
    capacity for it."""
    reps = obs.replicas
    rank = planning_rank(obs.line)
    return TierState(
        waiting=waiting(obs), oldest_wait_s=obs.oldest_wait_s, arrival_rate=arrival_rate(obs),
        service_rate=service_rate(obs), ready=reps.ready, starting=reps.starting, draining=reps.draining,
        per_replica_rate=cap.rate_of(rank), startup_s=cap.startup_s, prewarm_floor=prewarm_floor,
        budget_ceiling=budget_ceiling, gpu_ceiling=gpu_ceiling, calm_since=calm_since, calm_keep=calm_keep,
        rate_window_s=obs.window_s, batch=cap.batch_of(rank))
