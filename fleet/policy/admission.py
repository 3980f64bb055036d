"""Admission: join the line, or be refused now with a reason and a truthful retry time. Pure; no I/O.

The gateway observes a tier (line by class, completions, replicas, budget
state) and asks `admit` through `fleet.policy.observation.judge_admission`; the
simulator asks the same function the same way, in simulated time. The rule
(docs/architecture.md, "What the policy keeps from its sources", refined by
docs/decisions/0009 and 0010):

    wait in line   = start-up still to pay + requests ahead of it of its class or higher / service rate
    time to finish = wait in line + its own expected service time

- `budget_exhausted` for classes below `committed` while the tier's budget is spent;
- `deadline_unmeetable` when the time to finish exceeds the caller's deadline;
- `drain_exceeded` when the wait in line exceeds the class's wait limit for the tier;
- otherwise admitted.

The service rate is never infinite and never zero: a tier with no replica
yet predicts from its expected start-up time and the modelled rate of one
replica, so a cold tier says "about 15 s", not "never".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fleet.config import Priority

Reason = Literal["drain_exceeded", "deadline_unmeetable", "budget_exhausted"]
Basis = Literal["measured", "model", "cold_start", "starting"]

# A busy spell shorter than this, or with fewer completions, is too little evidence to
# replace the calibrated model with a measurement.
MIN_BUSY_S = 1.0
MIN_BUSY_COMPLETIONS = 4


@dataclass(frozen=True, slots=True)
class ServiceForecast:
    """How fast the tier will serve its line, and after how long."""

    rate: float  # requests per second, > 0
    delay_s: float  # seconds before any replica serves (cold start still to pay), >= 0
    basis: Basis  # where the rate came from, for the refusal message and the status page
    # Slots of ready replicas running nothing now: that many calls start at once, whatever the
    # rate (a call with a free slot waits for no completion: invariant 8). None: not known (no
    # replica reported), and the line is taken as a fluid that drains at the rate.
    free: int | None = None


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """Join the line or be refused, with everything that explains it."""

    admitted: bool
    reason: Reason | None  # None when admitted
    predicted_wait_s: float
    bound_s: float  # the limit it was judged against: min(deadline, class wait limit)
    retry_after_s: int  # whole seconds, >= 1 when refused, 0 when admitted
    ahead: int
    message: str
    # No retry soon can be served: a spent budget, or a bound that even an empty line cannot meet
    # (the caller's SDK is told `x-should-retry: false`).
    final: bool = False


def service_forecast(
    *,
    ready: int,
    starting_left_s: Sequence[float],
    per_replica_rate: float,
    startup_s: float,
    completions_in_window: int,
    window_s: float,
    busy_s: float = 0.0,
    completions_while_busy: int = 0,
    free_slots: int | None = None,
) -> ServiceForecast:
    """The tier's service rate for admission, robust when it has just started or has no replicas.

    - Ready replicas and a busy spell (the line has been non-empty for
      `busy_s`, so every slot was working) with enough completions in it:
      the measured rate is the tier's capacity. Trust it.
    - Ready replicas otherwise: completions over the window only show what
      arrived, not what the tier could do (an idle tier hit by a burst would
      read as slow), so take the larger of that and the modelled capacity.
    - No ready replica but some starting: the first one serves when its
      remaining start-up has passed, at the modelled rate of those starting.
    - Nothing at all: a replica must be started; pay the full start-up.
    """
    model = max(per_replica_rate, 1e-9)
    if ready > 0:
        free = None if free_slots is None else max(0, free_slots)
        if busy_s >= MIN_BUSY_S and completions_while_busy >= MIN_BUSY_COMPLETIONS:
            return ServiceForecast(completions_while_busy / busy_s, 0.0, "measured", free)
        measured = completions_in_window / window_s if window_s > 0 else 0.0
        if measured > ready * model:
            return ServiceForecast(measured, 0.0, "measured", free)
        return ServiceForecast(ready * model, 0.0, "model", free)
    if starting_left_s:
        return ServiceForecast(len(starting_left_s) * model, max(0.0, min(starting_left_s)), "starting")
    return ServiceForecast(model, max(0.0, startup_s), "cold_start")


def queue_wait_s(ahead: int, forecast: ServiceForecast) -> float:
    """Seconds from now until a worker starts this request, if it joins the line now.

    With the free slots known, the first `forecast.free` calls of the line start at once, and a
    call behind them needs a slot to free for it and each call between: `ahead - free + 1`
    completions at the service rate (not `ahead`: counting one short admits calls that end just
    past their deadline, every one of them). Not known: the line drains as a fluid."""
    ahead = max(0, ahead)
    if forecast.free is None:
        return forecast.delay_s + ahead / forecast.rate
    if ahead < forecast.free:
        return forecast.delay_s
    return forecast.delay_s + (ahead - forecast.free + 1) / forecast.rate


def predicted_wait_s(ahead: int, forecast: ServiceForecast, service_s: float) -> float:
    """Seconds from now until this request is served (its last token), if it joins the line now."""
    return queue_wait_s(ahead, forecast) + max(0.0, service_s)


def wait_with_ceiling_s(ahead: int, forecast: ServiceForecast, *, counted: int, ceiling: int | None,
                        per_replica_rate: float, startup_s: float) -> float:
    """Seconds until a worker starts this request if the tier's ceiling were reached now: the
    replicas it lacks are started at once and serve after a start-up, beside what serves now.

    What a committed call is judged on: it is refused only when even this cannot meet its
    deadline (the scaler is adding replicas; the class limits shed the classes below).
    `counted`: the replicas `forecast` already serves with. `ceiling` None: no limit on
    replicas, so the line itself costs no more than one start-up.
    """
    now_wait = queue_wait_s(ahead, forecast)
    extra = math.inf if ceiling is None else ceiling - counted
    if extra <= 0 or ahead <= 0:
        return now_wait
    startup = max(0.0, startup_s)
    served_meanwhile = forecast.rate * max(0.0, startup - forecast.delay_s)
    if ahead <= served_meanwhile:
        return now_wait
    added = extra * max(per_replica_rate, 1e-9)
    return min(now_wait, startup + (ahead - served_meanwhile) / (forecast.rate + added))


# The line drains at the forecast rate only on average. A Retry-After a little
# long costs the caller a moment; one too short costs it a second refusal, and
# teaches clients to ignore the header. So the drain estimate gets headroom.
RETRY_HEADROOM = 1.25


def format_duration(s: float) -> str:
    """A duration as a person reads it in a message: "1 ms", "250 ms", "2.40 s", "4.5 min", "6 h".

    Below a second in milliseconds: a 1 ms deadline must not read as "0.00 s"."""
    if math.isinf(s):
        return "unbounded"
    if s < 0.9995:  # would round to 1000 ms
        ms = s * 1000
        return f"{ms:.2g} ms" if ms < 10 else f"{ms:.0f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


def _whole_seconds(s: float) -> int:
    # Retry-After is whole seconds; rounding up keeps it honest, and 0 would invite a storm.
    return max(1, math.ceil(s - 1e-9))


def admit(
    priority: Priority,
    *,
    ahead: int,
    forecast: ServiceForecast,
    service_s: float,
    wait_limit_s: float,
    deadline_s: float | None,
    budget_exhausted: bool = False,
    budget_retry_in_s: float | None = None,
    committed_wait_s: float | None = None,
    deadline_ahead: int | None = None,
) -> AdmissionDecision:
    """Admit or refuse one request of class `priority`.

    `ahead`: requests in the line (and being admitted) of its class or
    higher. `service_s`: its own expected service time. `deadline_s`: the
    caller's X-Deadline-Ms in seconds (None: no deadline). `budget_retry_in_s`:
    seconds until the tier's budget window resets.

    Two different bounds, judged on two different times:
    - the class's wait limit bounds the time in the line (the drain signal:
      a planner tier tolerates 2 s of line even if its own answer takes 3 s);
    - the caller's deadline bounds the time to the last token.

    Committed work is served: its class's wait limit does not apply, and its
    deadline is judged on `committed_wait_s` (the wait if the ceiling's replicas
    were started now, `wait_with_ceiling_s`) when given: it is refused only
    with `deadline_unmeetable`, when even that cannot meet it.

    Retry-After: for the line, the time it needs to drain back under the
    bound: every second of draining takes a second off the predicted wait,
    if nothing of a higher class arrives, so the excess, with RETRY_HEADROOM
    for a rate that is only an average; for the budget, the time until the
    window resets.
    """
    in_line = queue_wait_s(ahead, forecast)
    # The deadline is judged on every call of its class ahead of it or placed before it later
    # (`deadline_ahead`; a fair line may still put later calls before it), the limit on `ahead`.
    done_in = (in_line if deadline_ahead is None else queue_wait_s(max(ahead, deadline_ahead), forecast)) \
        + max(0.0, service_s)
    deadline = math.inf if deadline_s is None else deadline_s
    if budget_exhausted and priority > Priority.committed:
        retry = budget_retry_in_s if budget_retry_in_s is not None and budget_retry_in_s > 0 else 60.0
        return AdmissionDecision(False, "budget_exhausted", done_in, min(deadline, wait_limit_s), _whole_seconds(retry),
                        ahead, f"the tier's budget is spent; {priority.name} work is refused until the window "
                        f"resets in {_whole_seconds(retry)} s (committed work is still served)", final=True)
    if priority == Priority.committed:
        if committed_wait_s is not None and committed_wait_s < done_in - max(0.0, service_s):
            in_line = min(in_line, committed_wait_s)
            done_in = committed_wait_s + max(0.0, service_s)
        wait_limit_s = math.inf  # the class limits shed from the bottom; committed is served
    over_deadline = done_in - deadline
    over_limit = in_line - wait_limit_s
    if over_deadline <= 0 and over_limit <= 0:
        return AdmissionDecision(True, None, done_in, min(deadline, wait_limit_s), 0, ahead, "admitted")
    return _refused(priority, ahead, forecast, service_s, in_line, done_in, deadline, wait_limit_s)


def _refused(priority: Priority, ahead: int, forecast: ServiceForecast, service_s: float, in_line: float,
             done_in: float, deadline: float, wait_limit_s: float) -> AdmissionDecision:
    """The refusal for the bound broken by more (that is what the caller must change), with a
    truthful Retry-After and a message that says why."""
    over_deadline, over_limit = done_in - deadline, in_line - wait_limit_s
    if over_deadline >= over_limit:
        reason: Reason = "deadline_unmeetable"
        bound, excess = deadline, over_deadline
        floor = forecast.delay_s + max(0.0, service_s)  # what no amount of draining removes
        what = f"its deadline of {format_duration(bound)}"
    else:
        reason, bound, excess = "drain_exceeded", wait_limit_s, over_limit
        floor = forecast.delay_s
        what = f"the {priority.name} wait limit of {format_duration(bound)}"
    final = floor > bound
    if final:
        # Even an empty line cannot meet it: come back when the line has drained
        # (and any start-up is paid); the message says the bound itself is too tight.
        retry = _whole_seconds(in_line)
        why = (f"this request's expected {'service time' if reason == 'deadline_unmeetable' else 'start-up wait'} "
               f"({format_duration(floor)}"
               + (f", {format_duration(forecast.delay_s)} of it start-up" if forecast.delay_s > 0 else "")
               + f") alone exceeds {what}")
    else:
        retry = _whole_seconds(excess * RETRY_HEADROOM)
        shown = done_in if reason == "deadline_unmeetable" else in_line
        what_of = "time to finish" if reason == "deadline_unmeetable" else "wait in line"
        why = (f"predicted {what_of} {format_duration(shown)} "
               f"({ahead} ahead at {forecast.rate:.2f}/s, {forecast.basis}) exceeds {what}")
    return AdmissionDecision(False, reason, done_in, bound, retry, ahead, f"{why}; retry after {retry} s", final)
