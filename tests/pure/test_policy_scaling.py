"""The tier decision and the pre-warm windows: the exercise's numbers, the rules, and
property tests of the invariants (never above the ceiling, never below the floor,
never ordering twice for replicas already starting, never removing while one starts,
removing at most one per step)."""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.config import BudgetWindow, PrewarmWindow, TierConfig
from fleet.policy import (
    PrewarmOrder,
    TierState,
    active_prewarm,
    backlog_during_startup,
    ceiling_of,
    cost_per_million_tokens,
    decide,
    decide_tier,
    line_need,
    littles_law,
    rate_with_margin,
    replicas_for,
    start_timeout_s,
    startup_seconds,
)

# --- The autoscaling exercise (docs/architecture.md) -----------------------------------


def test_exercise_numbers() -> None:
    assert startup_seconds(14e9, 2e9, 5) == 12  # 14 GB at 2 GB/s + 5 s
    assert backlog_during_startup(12, 8, 12) == 48  # (12 - 8) * 12
    assert replicas_for(12, 8) == 2
    assert replicas_for(0.1, 8) == 1  # at least one
    assert replicas_for(12, 8, headroom=0.5) == 3
    assert math.isclose(cost_per_million_tokens(2, 100), 5.5556, abs_tol=1e-4)
    assert math.isclose(cost_per_million_tokens(2, 50), 11.1111, abs_tol=1e-4)
    assert littles_law(4, 2) == 8


def test_exercise_decide_rules() -> None:
    assert decide(0, 1, 0, 12, 8) == 1  # need 2, have 1: add the difference
    assert decide(0, 1, 1, 12, 8) == 0  # the one starting already covers it: never order twice
    assert decide(0, 1, 0, 100, 8, max_replicas=4) == 3  # never beyond max
    assert decide(0, 3, 0, 4, 8) == -1  # need 1 < 3 ready, line empty: remove ONE
    assert decide(5, 3, 0, 4, 8) == 0  # not with a line
    assert decide(0, 3, 1, 4, 8) == 0  # not while one is starting
    assert decide(0, 1, 0, 0.1, 8, min_replicas=1) == 0  # never below min


# --- The tier decision --------------------------------------------------------------------

CFG = TierConfig(warm_floor=2, max_replicas=12, drain_threshold_s=2.0, scale_in_hold_s=30)
NOW = 1_000_000.0


def state(**kw: object) -> TierState:
    base: dict[str, object] = dict(waiting=0, oldest_wait_s=0.0, arrival_rate=0.0, service_rate=0.0, ready=2,
                                   starting=0, per_replica_rate=8.0, startup_s=12.0)
    base.update(kw)
    return TierState(**base)  # type: ignore[arg-type]


def test_scale_out_on_drain_with_its_reason() -> None:
    # The worked example's open: 8 replicas, drain 4.1 s against 2 s; four more drain the line in time.
    d = decide_tier(state(waiting=41, service_rate=10.0, arrival_rate=10.0, ready=8, per_replica_rate=1.75),
                    CFG, NOW)
    assert (d.action, d.delta, d.code) == ("scale_out", 4, "drain")
    assert d.reason == "scale_out: drain 4.1 s > 2 s, +4 counting 0 starting"


def test_a_replica_that_joins_takes_a_batch_from_the_line_at_once() -> None:
    # The worked example's open again, knowing each replica runs a batch of 8: a replica that joins
    # takes 8 waiting calls the moment it is ready. Two more leave 41 - 16 = 25 to drain at
    # 10 x 1.75/s: 1.4 s, inside the 2 s threshold; the completion rate alone asked for four.
    d = decide_tier(state(waiting=41, service_rate=10.0, arrival_rate=10.0, ready=8, per_replica_rate=1.75,
                          batch=8), CFG, NOW)
    assert (d.action, d.delta, d.desired) == ("scale_out", 2, 10)
    assert line_need(41, 8, 1.75, 2.0, batch=8) == 10
    assert line_need(41, 8, 1.75, 2.0) == 12  # without the batch: the worked example's count
    # The planner's cold flash crowd: 8 slots, 11 s calls (0.71/s a replica), one ready, a
    # line of 8 with start-up's arrivals. The rate alone asked for 6; two carry it.
    assert line_need(8, 1, 8 / 11.3, 2.0) == 6
    assert line_need(8, 1, 8 / 11.3, 2.0, batch=8) == 2
    # A line the ready replicas drain in time needs no one new, batch or not.
    assert line_need(5, 2, 8.0, 2.0, batch=8) == line_need(5, 2, 8.0, 2.0) == 1
    assert line_need(0, 2, 8.0, 2.0, batch=8) == 0


@settings(max_examples=300, deadline=None)
@given(backlog=st.floats(0, 5000), ready=st.integers(0, 40), rate=st.floats(0.05, 50),
       thr=st.floats(0.5, 30), batch=st.integers(1, 64))
def test_the_batch_never_asks_for_more_and_the_order_drains_the_line(backlog: float, ready: int, rate: float,
                                                                      thr: float, batch: int) -> None:
    n = line_need(backlog, ready, rate, thr, batch)
    assert n <= line_need(backlog, ready, rate, thr)
    if backlog > 0:
        # What n replicas leave in line after the new ones take their batch drains in time...
        assert backlog - max(0, n - ready) * batch <= thr * n * rate * (1 + 1e-9) + 1e-9
        # ...and one fewer would not.
        m = n - 1
        assert m < 0 or backlog - max(0, m - ready) * batch > thr * m * rate * (1 - 1e-9) - 1e-9


def test_scale_out_counts_the_backlog_that_piles_up_during_start_up() -> None:
    # 12/s against 8/s of capacity with a 12 s start-up: 48 more requests arrive before help does.
    s = state(ready=1, arrival_rate=12.0, service_rate=8.0, waiting=16, oldest_wait_s=2.5)
    d = decide_tier(s, TierConfig(warm_floor=1, max_replicas=20), NOW)
    # (16 + 48) requests to drain within 2 s at 8/s each: 4 replicas; 3 more.
    assert (d.action, d.delta, d.desired) == ("scale_out", 3, 4)
    assert d.reason.endswith("+3 counting 0 starting")


def test_scale_out_for_arrivals_before_a_line_forms() -> None:
    d = decide_tier(state(arrival_rate=30.0, service_rate=16.0, startup_s=0.0), CFG, NOW)
    assert (d.action, d.delta, d.code) == ("scale_out", 2, "arrival")
    assert "arrivals 30.0/s need 4 at 8.0/s each" in d.reason
    # With a 12 s start-up, 168 requests pile up before help arrives: order for them now.
    d = decide_tier(state(arrival_rate=30.0, service_rate=16.0, startup_s=12.0), CFG, NOW)
    assert (d.action, d.delta, d.code) == ("scale_out", 9, "line")
    assert "line 0 + 168 arriving during 12 s of start-up needs 11 to drain in 2 s" in d.reason


def test_replicas_starting_are_counted_and_never_ordered_twice() -> None:
    d = decide_tier(state(waiting=41, service_rate=10.0, ready=8, starting=4, per_replica_rate=1.75,
                          arrival_rate=10.0), CFG, NOW)
    assert (d.action, d.delta, d.reason) == ("hold", 0, "hold: 4 starting")
    # Still more needed than ready + starting: only the difference.
    d = decide_tier(state(waiting=41, service_rate=10.0, ready=8, starting=2, per_replica_rate=1.75,
                          arrival_rate=10.0), CFG, NOW)
    assert (d.action, d.delta) == ("scale_out", 2)
    assert d.reason.endswith("+2 counting 2 starting")


def test_ceiling_is_the_smallest_of_max_budget_and_gpus() -> None:
    assert ceiling_of(12, None, None) == (12, "max_replicas")
    assert ceiling_of(12, 5, 7) == (5, "budget")
    assert ceiling_of(12, 9, 7) == (7, "gpu_memory")
    assert ceiling_of(4, 4, None) == (4, "budget")  # a tie names the budget
    hot = dict(waiting=100, service_rate=4.0, ready=4, oldest_wait_s=10.0)
    d = decide_tier(state(**hot, budget_ceiling=4), CFG, NOW)
    assert (d.action, d.delta, d.code) == ("capped", 0, "budget")
    assert d.reason.startswith("capped: budget")
    d = decide_tier(state(**hot, gpu_ceiling=4, budget_ceiling=9), CFG, NOW)
    assert d.reason.startswith("capped: gpu_memory") and d.ceiling == 4
    d = decide_tier(state(**hot, budget_ceiling=6), CFG, NOW)  # room for two: take them, say why not more
    assert (d.action, d.delta) == ("scale_out", 2) and d.reason.endswith("(capped: budget at 6)")


def test_above_a_lowered_ceiling_the_tier_steps_down_by_the_same_careful_rules() -> None:
    # The budget now allows 3 of the 6 running; demand would keep all 6.
    busy = state(ready=6, arrival_rate=45.0, service_rate=45.0, budget_ceiling=3, calm_since=NOW - 31)
    d = decide_tier(busy, CFG, NOW)
    assert (d.action, d.delta, d.code) == ("scale_in", -3, "budget")  # to the ceiling, in one step
    assert d.reason == "scale_in: calm 31 s >= 30 s, 6 -> 3 (floor 2, above the ceiling 3 (budget))"
    assert decide_tier(dataclasses.replace(busy, starting=1), CFG, NOW).reason == "hold: 1 starting"
    # A queued line does not keep the tier above its ceiling: the steps drain, the rest serve the line.
    queued = decide_tier(dataclasses.replace(busy, waiting=400, oldest_wait_s=9.0, service_rate=40.0), CFG, NOW)
    assert (queued.action, queued.delta, queued.code) == ("scale_in", -3, "budget")
    assert decide_tier(dataclasses.replace(busy, calm_since=NOW - 5), CFG, NOW).code == "hold_period"
    # Never below the floor, whatever the budget.
    assert decide_tier(state(ready=2, budget_ceiling=0, calm_since=NOW - 99), CFG, NOW).action == "hold"


def test_floor_is_the_larger_of_warm_floor_and_prewarm() -> None:
    d = decide_tier(state(ready=0), CFG, NOW)
    assert (d.action, d.delta, d.code, d.floor) == ("scale_out", 2, "floor", 2)
    assert d.reason == "scale_out: floor 2 (warm floor), +2 counting 0 starting"
    d = decide_tier(state(ready=2, prewarm_floor=8), CFG, NOW)
    assert (d.action, d.delta, d.floor) == ("scale_out", 6, 8)
    assert d.reason == "scale_out: floor 8 (pre-warm), +6 counting 0 starting"
    # A floor the budget cannot pay for is capped, and says so.
    d = decide_tier(state(ready=2, prewarm_floor=8, budget_ceiling=2), CFG, NOW)
    assert (d.action, d.code) == ("capped", "budget")


def test_scale_in_only_after_the_hold_down_to_the_highest_need_it_saw() -> None:
    idle = state(ready=5)
    d = decide_tier(idle, CFG, NOW)
    assert d.action == "hold" and d.code == "hold_period" and d.calm_since == NOW and d.calm_keep == 0
    d = decide_tier(dataclasses.replace(idle, calm_since=NOW - 29), CFG, NOW)
    assert d.action == "hold" and d.reason == "hold: calm 29 s of 30 s before scale-in"
    d = decide_tier(dataclasses.replace(idle, calm_since=NOW - 30), CFG, NOW)
    assert (d.action, d.delta) == ("scale_in", -3)  # nothing needed them over the hold: to the floor
    assert d.reason == ("scale_in: calm 30 s >= 30 s, 5 -> 2 (floor 2, need at most 0 with noise margin "
                        "over the hold)")
    assert d.calm_since == NOW  # the next step waits a whole hold again
    # A need of 4 seen during the hold (carried in calm_keep) bounds the step: 5 -> 4, and a tick
    # that needs 3 now does not lower what the hold saw.
    d = decide_tier(dataclasses.replace(idle, calm_since=NOW - 30, calm_keep=4, arrival_rate=20.0,
                                        service_rate=20.0), CFG, NOW)
    assert (d.action, d.delta) == ("scale_in", -1) and "5 -> 4" in d.reason
    assert d.calm_keep == 3  # the new hold starts from the need now
    # A hold that saw a need of every replica left (one died since): no step below it.
    d = decide_tier(dataclasses.replace(idle, calm_since=NOW - 30, calm_keep=5), CFG, NOW)
    assert (d.action, d.code, d.reason) == ("hold", "need_kept", "hold: the hold saw a need of 5 (have 5)")
    # The hold carries its highest need from tick to tick.
    d = decide_tier(dataclasses.replace(idle, calm_since=NOW - 10, calm_keep=1, arrival_rate=20.0,
                                        service_rate=20.0), CFG, NOW)
    assert d.action == "hold" and d.calm_keep == 3
    # Never with a line, never while one starts (even after the hold).
    d = decide_tier(dataclasses.replace(idle, calm_since=NOW - 99, waiting=1, service_rate=5.0), CFG, NOW)
    assert d.reason == "hold: line not empty (1 waiting)"
    d = decide_tier(dataclasses.replace(idle, calm_since=NOW - 99, starting=1), CFG, NOW)
    assert d.reason == "hold: 1 starting"
    # Never below the floor; never while the demand still needs the replicas.
    assert decide_tier(state(ready=2, calm_since=NOW - 99), CFG, NOW).action == "hold"
    assert decide_tier(state(ready=5, arrival_rate=39.0, service_rate=39.0, calm_since=NOW - 99), CFG,
                       NOW).action == "hold"


def test_drain_over_threshold_resets_the_hold_but_a_short_calm_line_does_not() -> None:
    d = decide_tier(state(ready=5, waiting=50, service_rate=5.0, calm_since=NOW - 20), CFG, NOW)
    assert d.calm_since is None
    d = decide_tier(state(ready=5, waiting=2, service_rate=30.0, oldest_wait_s=0.1, calm_since=NOW - 20), CFG, NOW)
    assert d.calm_since == NOW - 20  # a brief, quickly served line is no reason to start the wait over


def test_a_raised_floor_comes_down_to_the_need_a_hold_after_the_window() -> None:
    """After a pre-warm to 8 ends, the tier keeps what the traffic needs over a whole hold, and
    gives back the rest in one step; with no traffic, down to the warm floor."""
    cfg = TierConfig(warm_floor=2, max_replicas=12, scale_in_hold_s=30)
    for rate, left in ((0.0, 2), (20.0, 3)):  # 20/s at 8/s a replica needs 3
        ready, calm, keep, removals = 8, None, 0, []
        for t in range(0, 400, 1):  # one tick a second
            d = decide_tier(state(ready=ready, calm_since=calm, calm_keep=keep, arrival_rate=rate,
                                  service_rate=rate), cfg, NOW + t)
            calm, keep = d.calm_since, d.calm_keep
            if d.action == "scale_in":
                ready += d.delta
                removals.append(t)
        assert (ready, removals) == (left, [30])


def test_the_oldest_wait_is_a_second_signal() -> None:
    # Drain looks fine on a stale service rate, but someone has waited 5 s.
    d = decide_tier(state(ready=1, waiting=8, service_rate=8.0, oldest_wait_s=5.0, per_replica_rate=2.0),
                    TierConfig(warm_floor=1), NOW)
    assert d.action == "scale_out" and "oldest wait 5.0 s > 2 s" in d.reason


def test_scale_from_zero() -> None:
    cfg = TierConfig(warm_floor=0, max_replicas=4)
    assert decide_tier(state(ready=0), cfg, NOW).action == "hold"
    d = decide_tier(state(ready=0, waiting=1, oldest_wait_s=0.0), cfg, NOW)
    assert (d.action, d.delta) == ("scale_out", 1)
    assert "nothing served" in d.reason


def test_start_timeout_grows_with_the_start_up() -> None:
    assert start_timeout_s(0) == 10
    assert start_timeout_s(60) == 130


# --- Pre-warm windows --------------------------------------------------------------------

NY = ZoneInfo("America/New_York")
OPEN = PrewarmWindow(cron="25 8 * * 1-5", floor=8, duration_s=2700)


def at(y: int, mo: int, d: int, h: int, mi: int, s: int = 0) -> float:
    return datetime(y, mo, d, h, mi, s, tzinfo=NY).timestamp()


def test_window_opens_early_by_the_start_up_and_closes_on_time() -> None:
    # Monday 2026-11-02, the window is 08:25-09:10 New York time; a 12 s start-up.
    def floor(t: float) -> int:
        return active_prewarm([OPEN], [], t, 12.0, "America/New_York").floor

    assert floor(at(2026, 11, 2, 8, 24, 40)) == 0
    assert floor(at(2026, 11, 2, 8, 24, 48)) == 8  # 12 s early: resident at 08:25
    assert floor(at(2026, 11, 2, 8, 25)) == 8
    pw = active_prewarm([OPEN], [], at(2026, 11, 2, 9, 9, 59), 12.0, "America/New_York")
    assert pw.floor == 8 and pw.until == at(2026, 11, 2, 9, 10) and pw.source == "schedule 25 8 * * 1-5"
    assert floor(at(2026, 11, 2, 9, 10)) == 0
    assert floor(at(2026, 11, 7, 8, 30)) == 0  # Saturday
    # Read in UTC, the same cron is a different instant.
    assert active_prewarm([OPEN], [], at(2026, 11, 2, 8, 30), 12.0, "UTC").floor == 0


def test_operator_orders_and_the_highest_floor_wins() -> None:
    t = at(2026, 11, 2, 8, 30)
    pw = active_prewarm([OPEN], [PrewarmOrder(10, t + 60, "x"), PrewarmOrder(20, t - 1, "old")], t, 12.0,
                        "America/New_York")
    assert (pw.floor, pw.source, pw.until) == (10, "operator", t + 60)
    assert active_prewarm([OPEN], [PrewarmOrder(3, t + 60)], t, 12.0, "America/New_York").floor == 8
    assert active_prewarm([], [], t, 12.0).floor == 0


@pytest.mark.parametrize("cron", ["* * * * *", "*/5 * * * * */10"])
def test_frequent_windows_stay_cheap_and_correct(cron: str) -> None:
    w = PrewarmWindow(cron=cron, floor=2, duration_s=86400)
    assert active_prewarm([w], [], at(2026, 11, 2, 12, 0), 1.0).floor == 2


# --- Properties ---------------------------------------------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> tuple[TierState, TierConfig, float]:
    max_r = draw(st.integers(1, 20))
    cfg = TierConfig(warm_floor=draw(st.integers(0, max_r)), max_replicas=max_r,
                     drain_threshold_s=draw(st.floats(0.5, 30)), scale_in_hold_s=draw(st.floats(0, 120)))
    now = 1_000_000.0
    s = TierState(
        waiting=draw(st.integers(0, 2000)), oldest_wait_s=draw(st.floats(0, 120)),
        arrival_rate=draw(st.floats(0, 200)), service_rate=draw(st.floats(0, 200)),
        ready=draw(st.integers(0, 25)), starting=draw(st.integers(0, 10)),
        per_replica_rate=draw(st.floats(0.05, 50)), startup_s=draw(st.floats(0, 300)),
        prewarm_floor=draw(st.integers(0, 25)),
        budget_ceiling=draw(st.none() | st.integers(0, 25)), gpu_ceiling=draw(st.none() | st.integers(0, 25)),
        calm_since=draw(st.none() | st.floats(now - 500, now)), calm_keep=draw(st.integers(0, 25)),
    )
    return s, cfg, now


@settings(max_examples=400, deadline=None)
@given(cases())
def test_invariants(case: tuple[TierState, TierConfig, float]) -> None:
    s, cfg, now = case
    d = decide_tier(s, cfg, now)
    have = s.ready + s.starting
    floor = max(cfg.warm_floor, s.prewarm_floor)
    ceiling = min([cfg.max_replicas, *(c for c in (s.budget_ceiling, s.gpu_ceiling) if c is not None)])
    assert (d.floor, d.ceiling) == (floor, ceiling)
    assert d.reason.startswith(d.action + ":")
    if d.action == "scale_out":
        assert d.delta >= 1
        assert have + d.delta <= ceiling  # never above the ceiling
        # Never ordered twice: once the order is starting, the same observation orders nothing more.
        again = decide_tier(dataclasses.replace(s, starting=s.starting + d.delta), cfg, now)
        assert again.action != "scale_out" and again.delta <= 0
    elif d.action == "scale_in":
        assert d.delta <= -1
        assert s.starting == 0  # never while starting
        assert s.waiting == 0 or have > ceiling  # only with an empty line, unless above the ceiling
        assert have + d.delta >= floor  # never below the floor
        if have > ceiling:
            assert have + d.delta >= ceiling  # above the ceiling: down to it, no further
        else:  # never below the highest need the hold saw (carried in, or seen now)
            assert have + d.delta >= s.calm_keep if s.calm_since is not None else True
        # Calm for the whole hold (a calm that starts now is enough only for a hold of 0).
        assert now - (now if s.calm_since is None else s.calm_since) >= cfg.scale_in_hold_s
        assert d.code == "idle" or have > ceiling  # for lack of demand, or above a lowered ceiling
    else:
        assert d.delta == 0
    # Below the floor with room under the ceiling: the floor is restored at once.
    if have < min(floor, ceiling):
        assert d.action == "scale_out" and have + d.delta >= min(floor, ceiling)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.floats(0, 60)), min_size=5, max_size=60),
       st.integers(1, 12), st.integers(0, 4))
def test_a_run_of_ticks_stays_between_floor_and_ceiling(trace: list[tuple[int, float]], max_r: int,
                                                          start_ticks: int) -> None:
    """Execute the decisions against a toy fleet whose replicas take `start_ticks` to start."""
    cfg = TierConfig(warm_floor=min(1, max_r), max_replicas=max_r, scale_in_hold_s=3)
    ready, starting, calm = cfg.warm_floor, [], None  # starting: ticks left per replica
    for tick, (waiting, arrivals) in enumerate(trace):
        s = TierState(waiting=waiting, oldest_wait_s=0.0, arrival_rate=arrivals, service_rate=ready * 4.0,
                      ready=ready, starting=len(starting), per_replica_rate=4.0, startup_s=start_ticks,
                      calm_since=calm)
        d = decide_tier(s, cfg, float(tick))
        calm = d.calm_since
        before = ready + len(starting)
        if d.action == "scale_out":
            starting += [start_ticks] * d.delta
        elif d.action == "scale_in":
            ready -= 1
        after = ready + len(starting)
        if after > before:
            assert after <= max_r  # never above the ceiling
        if after < before:
            assert after == before - 1 and after >= cfg.warm_floor  # one at a time, never below the floor
            assert not starting  # never while one is starting
        ready += sum(1 for t in starting if t <= 0)
        starting = [t - 1 for t in starting if t > 0]


def test_calm_before_a_burst_does_not_remove_a_replica_in_its_first_lull() -> None:
    """A calm period carried in from the quiet must not let a one-tick lull in a
    burst remove a replica the next tick orders again (seen in the market-open replay)."""
    from fleet.config import TierConfig
    from fleet.policy.scaling import TierState, decide_tier

    cfg = TierConfig(warm_floor=1, max_replicas=12, drain_threshold_s=2.0, scale_in_hold_s=30)
    quiet = TierState(waiting=0, oldest_wait_s=0, arrival_rate=1.0, service_rate=1.0, ready=4, starting=0,
                      per_replica_rate=10.0, startup_s=5.0, calm_since=0.0)
    d = decide_tier(quiet, cfg, now=1000.0)
    assert d.action == "scale_in"  # long calm, spare replicas: one goes
    # The burst needs every ready replica: calm ends, even with an empty line this instant.
    busy = TierState(waiting=0, oldest_wait_s=0, arrival_rate=38.0, service_rate=38.0, ready=4, starting=0,
                     per_replica_rate=10.0, startup_s=5.0, calm_since=0.0)
    d = decide_tier(busy, cfg, now=2000.0)
    assert d.action in ("hold", "scale_out") and d.calm_since is None
    # A lull on the next tick starts the hold afresh instead of removing a replica.
    lull = TierState(waiting=0, oldest_wait_s=0, arrival_rate=25.0, service_rate=25.0, ready=4, starting=0,
                     per_replica_rate=10.0, startup_s=5.0, calm_since=d.calm_since)
    d = decide_tier(lull, cfg, now=2001.0)
    assert d.action == "hold" and d.calm_since == 2001.0


def test_draining_replicas_count_against_the_ceiling() -> None:
    from fleet.config import TierConfig
    from fleet.policy.scaling import TierState, decide_tier

    cfg = TierConfig(warm_floor=1, max_replicas=4, drain_threshold_s=2.0)
    s = TierState(waiting=100, oldest_wait_s=5, arrival_rate=50.0, service_rate=10.0, ready=3, starting=0,
                  per_replica_rate=10.0, startup_s=5.0, draining=1)
    d = decide_tier(s, cfg, now=0.0)
    assert d.action == "capped" and d.delta == 0 and "1 draining" in d.reason


def test_a_busy_line_does_not_hold_the_tier_above_a_lowered_ceiling() -> None:
    """The reviewer's replay: the planner burst to 6, then the budget ceiling fell to 3
    with committed work queued; it used to answer `hold: line not empty` forever."""
    cfg = TierConfig(warm_floor=1, max_replicas=6, drain_threshold_s=2.0, scale_in_hold_s=120)
    ready, calm, steps = 6, None, []
    for t in range(0, 600):
        s = TierState(waiting=300, oldest_wait_s=8.0, arrival_rate=60.0, service_rate=ready * 10.0, ready=ready,
                      starting=0, per_replica_rate=10.0, startup_s=20.0, prewarm_floor=3, budget_ceiling=3,
                      calm_since=calm)
        d = decide_tier(s, cfg, NOW + t)
        calm = d.calm_since
        assert d.action in ("hold", "scale_in", "capped") and d.delta <= 0  # never adds above the ceiling
        if d.action == "scale_in":
            ready += d.delta
            steps.append(t)
    assert ready == 3  # back under the ceiling, not below it
    assert steps == [120]  # a hold after it went over, to the ceiling in one step
    # Never while a replica starts, even above the ceiling.
    s = TierState(waiting=300, oldest_wait_s=8.0, arrival_rate=60.0, service_rate=60.0, ready=5, starting=1,
                  per_replica_rate=10.0, startup_s=20.0, budget_ceiling=3, calm_since=NOW - 999)
    assert decide_tier(s, cfg, NOW).reason == "hold: 1 starting"


def test_poisson_noise_neither_orders_nor_gives_back_a_replica() -> None:
    """The issue's flap: 20-24/s on two replicas of 11.8/s each. A rate counted over 10 s
    wanders by sqrt(rate / 10) = 1.5/s: 23.7/s is no proof that a third is needed, and 24/s
    no proof that the third can go."""
    cfg = TierConfig(warm_floor=2, max_replicas=12, drain_threshold_s=2.0, scale_in_hold_s=60)
    base = dict(waiting=0, oldest_wait_s=0.0, service_rate=22.0, starting=0, per_replica_rate=11.8,
                startup_s=2.0, rate_window_s=10.0)
    d = decide_tier(TierState(arrival_rate=23.7, ready=2, **base), cfg, NOW)  # type: ignore[arg-type]
    assert d.action == "hold"
    d = decide_tier(TierState(arrival_rate=30.0, ready=2, **base), cfg, NOW)  # type: ignore[arg-type]
    assert (d.action, d.delta, d.code) == ("scale_out", 1, "arrival")  # clear of the noise: order it
    # Three ready at 24/s: the margin is the noise of a count over the 60 s hold (the hold keeps the
    # highest need it sees, tick after tick), 24 + 2 x sqrt(24 / 60) = 25.3 needs three: no calm,
    # however long it lasts. A 10 s window's margin on top of the hold's highest counted it twice.
    d = decide_tier(TierState(arrival_rate=24.0, ready=3, calm_since=NOW - 999, **base), cfg, NOW)  # type: ignore[arg-type]
    assert d.action == "hold" and d.calm_since is None and "3 with noise margin" in d.reason
    # On a tier with budget windows the margin stays the rate window's: 22 + 2 x 1.48 = 25 needs three.
    windowed = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"windows": [
        BudgetWindow(name="open", cron="25 8 * * 1-5", duration_s=3600, usd=50)]})})
    d = decide_tier(TierState(arrival_rate=22.0, ready=3, calm_since=NOW - 999, **base), windowed, NOW)  # type: ignore[arg-type]
    assert d.action == "hold" and d.calm_since is None and "3 with noise margin" in d.reason
    # At 18/s (20.7 with the margin) two suffice: the hold runs and the third goes after it.
    calm = None
    for t in range(0, 61):
        d = decide_tier(TierState(arrival_rate=18.0, ready=3, calm_since=calm, **base), cfg, NOW + t)  # type: ignore[arg-type]
        calm = d.calm_since
    assert (d.action, d.delta) == ("scale_in", -1)
    assert rate_with_margin(22.0, 10.0) == pytest.approx(22.0 + 2 * (2.2 ** 0.5))
    assert rate_with_margin(22.0, 0.0) == 22.0 and rate_with_margin(1.0, 10.0, -5) == 0.0
