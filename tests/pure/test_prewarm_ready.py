"""Pre-warm windows that say when capacity must be ready (`ready_at`), the rule that plans their
start (the tier's p95 cold start measured, else modelled, and one tick), how `fleet status` shows
each window's plan, the config's errors, and the cron instants the scaler asks every tick."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from fleet.config import ConfigError, PrewarmWindow, TierConfig, load_config
from fleet.policy import ObservedReplica, PlanInput, PlanState, observe_tier, plan_tier
from fleet.policy.cron import next_after, next_start, prev_before
from fleet.policy.prewarm import (
    ColdStart,
    active_prewarm,
    p95,
    planning_cold_start,
    ready_lead_s,
    window_plans,
)
from fleetctl.status_table import window_line

NY = "America/New_York"
OPEN = PrewarmWindow(ready_at="30 8 * * 1-5", floor=8, duration_s=2400)


def at(d: int, h: int, mi: int, s: float = 0) -> float:
    """Epoch seconds of 2026-11-<d> h:mi:s in New York (the 2nd is a Monday)."""
    return datetime(2026, 11, d, h, mi, tzinfo=ZoneInfo(NY)).timestamp() + s


def test_p95_and_what_the_cold_start_rests_on() -> None:
    assert p95([12.0]) == 12.0
    assert p95([10.0, 20.0]) == pytest.approx(19.5)
    assert p95([float(x) for x in range(1, 101)]) == pytest.approx(95.05)
    # Launch to ready first; else the replicas' own; else the model, never below a timed-out start.
    assert planning_cold_start([10, 11, 30], [5.0], 18.0) == ColdStart(pytest.approx(28.1), 3, "launch to ready")
    assert planning_cold_start([], [4.0, 6.0], 18.0).source == "replicas' own"
    cold = planning_cold_start([], [], 18.0, at_least_s=40.0)
    assert (cold.seconds, cold.measured, cold.source) == (40.0, 0, "modelled")
    assert "no start-up measured yet" in cold.describe()
    assert "p95 of 3" in planning_cold_start([1, 2, 3], [], 9).describe()
    assert ready_lead_s(ColdStart(18.0, 5, "launch to ready"), 1.0) == 19.0


def test_a_ready_at_window_starts_a_p95_cold_start_and_a_tick_before_and_ends_on_time() -> None:
    lead = ready_lead_s(ColdStart(18.0, 5, "launch to ready"), 1.0)  # 19 s

    def floor(t: float) -> int:
        return active_prewarm([OPEN], [], t, 999.0, NY, ready_lead=lead).floor  # the cron lead is not used

    assert floor(at(2, 8, 29, 40)) == 0
    assert floor(at(2, 8, 29, 41)) == 8  # 08:30 - 18 s - 1 s
    pw = active_prewarm([OPEN], [], at(2, 9, 9, 59), 0.0, NY, ready_lead=lead)
    assert (pw.floor, pw.until, pw.source) == (8, at(2, 9, 10), "ready_at 30 8 * * 1-5")
    assert floor(at(2, 9, 10)) == 0
    assert floor(at(7, 8, 29, 50)) == 0  # a Saturday
    # A cron window beside it keeps its own lead (its start, opened early by the expected start-up).
    cron = PrewarmWindow(cron="25 8 * * 1-5", floor=3, duration_s=600)
    assert active_prewarm([OPEN, cron], [], at(2, 8, 24, 40), 20.0, NY, ready_lead=lead).floor == 3


def _plan_at(now: float, tc: TierConfig, startups: tuple[float, ...], engines: float | None) -> int:
    reps = [ObservedReplica("r1", "ready", tc.slots, 0, now - 3600, engines)]
    obs = observe_tier("t", now, 10.0, replicas=reps, startups_measured=startups)
    return plan_tier(PlanInput(obs, tc, 1.0, (), None), PlanState()).prewarm.floor


def test_the_scaler_plans_on_what_it_measured_and_on_the_model_until_then() -> None:
    tc = TierConfig(warm_floor=1, max_replicas=10, prewarm=[OPEN], budget={"timezone": NY},
                    capacity={"startup_s": 5.0})  # the model says 5 s
    # Nothing measured: 5 s and a tick, so 08:29:54 and not a second before.
    assert _plan_at(at(2, 8, 29, 53), tc, (), None) == 0
    assert _plan_at(at(2, 8, 29, 54), tc, (), None) == 8
    # Measured launch to ready (the slowest start counts): p95 of 10, 12, 40 s is 37.2 s.
    assert _plan_at(at(2, 8, 29, 21), tc, (10.0, 12.0, 40.0), 3.0) == 0
    assert _plan_at(at(2, 8, 29, 22), tc, (10.0, 12.0, 40.0), 3.0) == 8
    # No launch measured yet, only the replicas' own cold starts: 30 s.
    assert _plan_at(at(2, 8, 29, 29), tc, (), 30.0) == 8


def test_status_shows_each_windows_planned_start_and_why() -> None:
    cron = PrewarmWindow(cron="25 8 * * 1-5", floor=3, duration_s=600)
    plans = window_plans([OPEN, cron], at(2, 7, 0), lead_s=14.0, startup_s=12.0,
                         cold=ColdStart(18.0, 5, "launch to ready"), tick_s=1.0, tz=NY)
    ready, started = plans
    assert (ready.kind, ready.at, ready.start, ready.end, ready.active) == (
        "ready_at", at(2, 8, 30), at(2, 8, 29, 41), at(2, 9, 10), False)
    assert "p95 of 5 start-ups measured (launch to ready), 18.0 s" in ready.why and "one tick" in ready.why
    assert (started.kind, started.start, started.at) == ("cron", at(2, 8, 24, 46), at(2, 8, 25))
    assert "expected start-up 12.0 s" in started.why
    # In force: the instance under way, marked active.
    (now,) = window_plans([OPEN], at(2, 8, 45), lead_s=0.0, startup_s=0.0, cold=ColdStart(18.0, 5, "x"),
                          tick_s=1.0, tz=NY)
    assert now.active and now.at == at(2, 8, 30)
    line = window_line("routing", {"kind": "ready_at", "floor": 8, "ready_by": ready.at, "start": ready.start,
                                   "end": ready.end, "active": False, "why": ready.why, "timezone": NY})
    assert "floor 8 ready by Mon 08:30:00, replicas start Mon 08:29:41" in line and "America/New_York" in line


@pytest.mark.parametrize(("window", "said"), [
    ("{cron: '25 8 * * 1-5', ready_at: '30 8 * * 1-5', floor: 2, duration_s: 60}", "not both"),
    ("{floor: 2, duration_s: 60}", "needs ready_at"),
    ("{ready_at: 'half past eight', floor: 2, duration_s: 60}", "not a valid cron"),
])
def test_a_window_with_both_times_or_neither_is_a_config_error_naming_the_field(tmp_path: Path, window: str,
                                                                                  said: str) -> None:
    p = tmp_path / "f.yaml"
    p.write_text(f"tiers:\n  t:\n    prewarm:\n      - {window}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "tiers.t.prewarm.0" in str(e.value) and said in str(e.value)
    assert "ready_at" in str(e.value) or "cron" in str(e.value)


def test_cron_instants_remembered_are_croniters_own() -> None:
    """Every tick asks; the answers come from a remembered span, and must be croniter's, also
    across the clock changes of a zone (2026-03-08 and 2026-11-01 in New York)."""
    rng = random.Random(7)
    for tz in (NY, "UTC"):
        zone = ZoneInfo(tz)
        for cron in ("25 8 * * 1-5", "*/5 * * * *", "30 1 * * *", "30 8 * * 1-5 15"):
            for start in (datetime(2026, 3, 7, tzinfo=zone), datetime(2026, 10, 31, tzinfo=zone)):
                t = start.timestamp()
                for _ in range(60):
                    t += rng.choice([1.0, 60.0, 0.5, 3600.0, 43200 * rng.random()])
                    base = datetime.fromtimestamp(t, zone)
                    assert next_start(cron, t, tz) == croniter(cron, base).get_next(float)
                    assert next_after(cron, base) == croniter(cron, base).get_next(datetime).timestamp()
                    nudged = base + timedelta(microseconds=1)
                    assert prev_before(cron, nudged) == croniter(cron, nudged).get_prev(datetime).timestamp()


def test_the_status_document_plans_each_window_on_the_replicas_cold_starts() -> None:
    from gateway.status import prewarm_windows

    tc = TierConfig(prewarm=[OPEN], budget={"timezone": NY}, capacity={"startup_s": 5.0})
    (w,) = prewarm_windows(tc, at(2, 7, 0), 5.0, [10.0, 30.0])
    assert (w["kind"], w["floor"], w["ready_by"], w["end"], w["active"], w["timezone"]) == (
        "ready_at", 8, at(2, 8, 30), at(2, 9, 10), False, NY)
    assert w["start"] == pytest.approx(at(2, 8, 30) - p95([10.0, 30.0]) - 1.0)
    assert "replicas' own" in w["why"]
    (m,) = prewarm_windows(tc, at(2, 7, 0), 5.0, [])  # no replica has reported one: the model
    assert m["start"] == at(2, 8, 29, 54) and "modelled" in m["why"]


def test_the_status_document_shows_the_plan_the_scaler_published() -> None:
    """With a scaler running, the page plans on the scaler's cold start (launch to ready, which
    counts the process start the replicas' own figures leave out) and its tick, so the start it
    shows is the one the scaler acts on."""
    from fleet.store.scaler_state import ScalerState
    from gateway.status import prewarm_windows

    tc = TierConfig(prewarm=[OPEN], budget={"timezone": NY}, capacity={"startup_s": 5.0})
    sc = ScalerState(floor=1, ceiling=4, ceiling_by="max_replicas", desired=1, action="hold", delta=0, reason="",
                     code="", at=0.0, ts=0.0, scaler="s", startup_s=12.0, tick_s=0.5, ready_cold_s=17.5,
                     ready_cold_measured=3, ready_cold_source="launch to ready")
    (w,) = prewarm_windows(tc, at(2, 7, 0), 5.0, [10.0, 30.0], sc)
    assert w["start"] == pytest.approx(at(2, 8, 30) - 17.5 - 0.5)  # not the replicas' own p95 nor a 1 s tick
    assert "p95 of 3 start-ups measured (launch to ready), 17.5 s" in w["why"] and "0.5 s (one tick)" in w["why"]
