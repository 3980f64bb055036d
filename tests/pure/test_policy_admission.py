"""The admission decision and its service forecast: pure functions, no Redis, no clock."""

from __future__ import annotations

import math

import pytest

from fleet.config import Priority
from fleet.policy import (
    ServiceForecast,
    admit,
    predicted_wait_s,
    replica_concurrency,
    service_forecast,
    startup_estimate,
    wait_with_ceiling_s,
)

READY = ServiceForecast(rate=10.0, delay_s=0.0, basis="model")


def test_empty_line_is_admitted_with_its_own_service_time() -> None:
    d = admit(Priority.background, ahead=0, forecast=READY, service_s=0.3, wait_limit_s=1.0, deadline_s=None)
    assert d.admitted and d.reason is None and d.retry_after_s == 0
    assert d.predicted_wait_s == pytest.approx(0.3)


def test_drain_exceeded_with_retry_after_the_excess_rounded_up() -> None:
    # 25 ahead at 10/s = 2.5 s in line against a 1 s limit: 1.5 s excess -> 2 s.
    d = admit(Priority.speculative, ahead=25, forecast=READY, service_s=0.5, wait_limit_s=1.0, deadline_s=30.0)
    assert not d.admitted and d.reason == "drain_exceeded"
    assert d.predicted_wait_s == pytest.approx(3.0) and d.retry_after_s == 2
    # After waiting that long the line has drained 20 requests' worth of 2 s: the same call fits.
    later = admit(Priority.speculative, ahead=25 - int(2 * READY.rate), forecast=READY, service_s=0.5,
                  wait_limit_s=1.0, deadline_s=30.0)
    assert later.admitted


def test_retry_after_is_at_least_one_second() -> None:
    d = admit(Priority.background, ahead=11, forecast=READY, service_s=0.5, wait_limit_s=1.0, deadline_s=None)
    assert not d.admitted and d.predicted_wait_s == pytest.approx(1.6) and d.retry_after_s == 1


def test_wait_limit_bounds_the_line_not_the_answer() -> None:
    # A planner answer that takes 3 s is no reason to refuse it from an empty line with a 2 s limit.
    d = admit(Priority.committed, ahead=0, forecast=READY, service_s=3.0, wait_limit_s=2.0, deadline_s=None)
    assert d.admitted and d.predicted_wait_s == pytest.approx(3.0)
    # But a deadline shorter than the answer is unmeetable.
    d = admit(Priority.committed, ahead=0, forecast=READY, service_s=3.0, wait_limit_s=2.0, deadline_s=2.5)
    assert d.reason == "deadline_unmeetable"


def test_deadline_tighter_than_the_limit_gives_deadline_unmeetable() -> None:
    d = admit(Priority.committed, ahead=5, forecast=READY, service_s=0.2, wait_limit_s=30.0, deadline_s=0.5)
    assert not d.admitted and d.reason == "deadline_unmeetable" and d.bound_s == 0.5
    # The limit tighter than the deadline: the line is what is wrong, not the deadline.
    d = admit(Priority.interactive, ahead=50, forecast=READY, service_s=0.2, wait_limit_s=2.0, deadline_s=60.0)
    assert d.reason == "drain_exceeded"
    # Committed work is served: its class limit sheds nothing, only its own deadline can refuse it.
    d = admit(Priority.committed, ahead=50, forecast=READY, service_s=0.2, wait_limit_s=2.0, deadline_s=60.0)
    assert d.admitted


def test_committed_is_refused_only_when_even_the_ceiling_started_now_misses_its_deadline() -> None:
    # 200 ahead at 10/s is 20 s of line: a 15 s deadline is unmeetable at today's replicas...
    now = admit(Priority.committed, ahead=200, forecast=READY, service_s=0.5, wait_limit_s=2.0, deadline_s=15.0)
    assert not now.admitted and now.reason == "deadline_unmeetable"
    # ...but with the ceiling's 8 replicas started now (5 s start-up, 5/s each) the line clears in
    # 5 s + (200 - 50) / (10 + 6 * 5) = 8.75 s: the scaler is adding them, so it is admitted.
    w = wait_with_ceiling_s(200, READY, counted=2, ceiling=8, per_replica_rate=5.0, startup_s=5.0)
    assert w == pytest.approx(5.0 + 150 / 40)
    d = admit(Priority.committed, ahead=200, forecast=READY, service_s=0.5, wait_limit_s=2.0, deadline_s=15.0,
              committed_wait_s=w)
    assert d.admitted
    # At the ceiling already, nothing more is coming: the deadline is judged on the line as it is.
    assert wait_with_ceiling_s(200, READY, counted=2, ceiling=2, per_replica_rate=5.0, startup_s=5.0) == 20.0
    # And a deadline shorter than the start-up is still unmeetable, with an honest Retry-After.
    w = wait_with_ceiling_s(200, READY, counted=2, ceiling=8, per_replica_rate=5.0, startup_s=5.0)
    d = admit(Priority.committed, ahead=200, forecast=READY, service_s=0.5, wait_limit_s=2.0, deadline_s=4.0,
              committed_wait_s=w)
    assert d.reason == "deadline_unmeetable" and d.retry_after_s >= math.ceil(w + 0.5 - 4.0)


def test_service_time_alone_over_the_deadline_says_so() -> None:
    d = admit(Priority.committed, ahead=0, forecast=READY, service_s=3.0, wait_limit_s=30.0, deadline_s=1.0)
    assert d.reason == "deadline_unmeetable" and "alone exceeds" in d.message and d.retry_after_s >= 1


def test_budget_exhausted_refuses_below_committed_only() -> None:
    kw = dict(ahead=0, forecast=READY, service_s=0.1, wait_limit_s=10.0, deadline_s=None, budget_exhausted=True,
              budget_retry_in_s=41.2)
    assert admit(Priority.committed, **kw).admitted  # type: ignore[arg-type]
    for p in (Priority.interactive, Priority.speculative, Priority.background):
        d = admit(p, **kw)  # type: ignore[arg-type]
        assert not d.admitted and d.reason == "budget_exhausted" and d.retry_after_s == 42


def test_a_higher_class_is_judged_only_on_what_is_ahead_of_it() -> None:
    # The gateway passes `ahead` = the line of class >= c; a committed call behind 100 background ones
    # has nothing ahead of it and is admitted, the background call is not.
    assert admit(Priority.committed, ahead=0, forecast=READY, service_s=0.1, wait_limit_s=1.0, deadline_s=None).admitted
    assert not admit(Priority.background, ahead=100, forecast=READY, service_s=0.1, wait_limit_s=1.0,
                     deadline_s=None).admitted


def test_forecast_with_no_replica_predicts_from_startup_not_infinity() -> None:
    f = service_forecast(ready=0, starting_left_s=[], per_replica_rate=4.0, startup_s=12.0,
                         completions_in_window=0, window_s=10.0)
    assert f.basis == "cold_start" and f.rate == 4.0 and f.delay_s == 12.0
    w = predicted_wait_s(8, f, 0.5)
    assert math.isfinite(w) and w == pytest.approx(12.0 + 2.0 + 0.5)
    d = admit(Priority.committed, ahead=8, forecast=f, service_s=0.5, wait_limit_s=30.0, deadline_s=5.0)
    assert d.reason == "deadline_unmeetable" and 12 <= d.retry_after_s <= 15


def test_forecast_while_replicas_start_uses_the_first_to_finish() -> None:
    f = service_forecast(ready=0, starting_left_s=[7.0, 2.5, -1.0], per_replica_rate=4.0, startup_s=12.0,
                         completions_in_window=0, window_s=10.0)
    assert f.basis == "starting" and f.delay_s == 0.0 and f.rate == 12.0  # one is overdue: any moment now
    f = service_forecast(ready=0, starting_left_s=[7.0, 2.5], per_replica_rate=4.0, startup_s=12.0,
                         completions_in_window=0, window_s=10.0)
    assert f.delay_s == 2.5 and f.rate == 8.0


def test_forecast_idle_tier_hit_by_a_burst_uses_the_model() -> None:
    # 3 completions in 10 s only show what arrived; two ready replicas can do 2 x 5/s.
    f = service_forecast(ready=2, starting_left_s=[], per_replica_rate=5.0, startup_s=10.0,
                         completions_in_window=3, window_s=10.0)
    assert f.basis == "model" and f.rate == 10.0


def test_forecast_busy_tier_trusts_the_measured_rate() -> None:
    # The line has been non-empty for 4 s and 8 requests finished meanwhile: 2/s, whatever the model says.
    f = service_forecast(ready=2, starting_left_s=[], per_replica_rate=5.0, startup_s=10.0,
                         completions_in_window=30, window_s=10.0, busy_s=4.0, completions_while_busy=8)
    assert f.basis == "measured" and f.rate == pytest.approx(2.0)
    # Too short a busy spell is not evidence yet.
    f = service_forecast(ready=2, starting_left_s=[], per_replica_rate=5.0, startup_s=10.0,
                         completions_in_window=30, window_s=10.0, busy_s=0.3, completions_while_busy=2)
    assert f.rate == 10.0
    # A measured rate above the model wins too (the model is pessimistic).
    f = service_forecast(ready=1, starting_left_s=[], per_replica_rate=5.0, startup_s=10.0,
                         completions_in_window=80, window_s=10.0)
    assert f.basis == "measured" and f.rate == 8.0


def test_expected_startup_prefers_measured() -> None:
    assert startup_estimate([], [], 12.0) == 12.0
    assert startup_estimate([30.0, 20.0, 25.0], [], 12.0) == 25.0
    assert startup_estimate([], [30.0, 20.0, 25.0], 12.0) == 25.0  # the engines' own, when nothing launched here
    assert startup_estimate([5.0], [30.0], 12.0) == 5.0  # launch to ready, measured here, first
    assert startup_estimate([], [], 12.0, at_least_s=40.0) == 40.0  # a start timed out after 40 s: the floor
    assert startup_estimate([20.0], [], 12.0, at_least_s=40.0) == 20.0  # until one is measured


def test_replica_concurrency_is_bounded_by_the_kv_cache() -> None:
    assert replica_concurrency(8, 100, 50) == 2
    assert replica_concurrency(8, 1_000_000, 50) == 8
    assert replica_concurrency(8, 10, 50) == 1  # never zero: one request always runs
    assert replica_concurrency(8, None, 50) == 8
