"""The one observation shape and its builders, the capacity profile and its calibration, the
scale-in victim and the fail-safe ceilings: pure functions, no Redis, no clock."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fleet.config import CapacityProfile, ConfigError, Priority, SimProfile, TierConfig, load_config
from fleet.policy import (
    AdmissionInput,
    BudgetSignal,
    Calibration,
    ObservedReplica,
    Replicas,
    TierObservation,
    admission_forecast,
    ahead_of,
    arrival_rate,
    budget_ceiling_for,
    calibrate,
    calibrated_capacity,
    decide_tier,
    drain_s,
    gpu_ceiling,
    initial_calibration,
    judge_admission,
    scale_in_victims,
    scaling_state,
    service_rate,
    tier_capacity,
    tier_has_budget,
    token_burn_since,
    token_burn_usd_per_s,
)
from fleet.replica_model import cold_start_s
from tests.harness import TEST_CONFIG

NOW = 1_800_000_000.0
TC = TierConfig(slots=4, drain_threshold_s=2.0, max_replicas=8,
                sim=SimProfile(weights_gb=4, load_gb_s=2, warmup_s=1, prefill_tokens_per_s=10000,
                               kv_capacity_tokens=65536, typical_prompt_tokens=100, typical_output_tokens=20))


def rep(rid: str, state: str = "ready", in_use: int = 0, started: float = NOW - 100,
        cold: float | None = None) -> ObservedReplica:
    return ObservedReplica(rid, state, 4, in_use, started, cold)


def obs(**kw) -> TierObservation:  # type: ignore[no-untyped-def]
    return TierObservation(**{"tier": "t", "now": NOW, "window_s": 10.0, **kw})


def test_meters_come_from_the_observation() -> None:
    o = obs(line=(1, 2, 3, 4), arrivals_in_window=50, completions_in_window=20)
    assert (arrival_rate(o), service_rate(o)) == (5.0, 2.0)
    assert drain_s(o) == 5.0  # 10 waiting at 2/s
    assert ahead_of(o, Priority.interactive) == 3 and ahead_of(o, Priority.background) == 10
    assert drain_s(obs(line=(1, 0, 0, 0))) == math.inf  # a line nothing serves
    assert drain_s(obs()) == 0.0


def test_capacity_defaults_to_the_sim_profile_and_can_be_told_apart() -> None:
    cap = tier_capacity(TC)
    p = TC.sim
    batch = min(TC.slots, p.kv_capacity_tokens // (p.typical_prompt_tokens + p.typical_output_tokens))
    step = p.decode_step.base_s + p.decode_step.per_seq_s * batch
    assert cap.startup_s == cold_start_s(p) == 3.0
    assert cap.service_s(100, 20) == pytest.approx(100 / 10000 + 20 * step)
    assert cap.per_replica_rate == pytest.approx(batch / (100 / 10000 + 20 * step))
    # A `capacity:` profile changes what the policy assumes, not how the sim engine behaves.
    told = TierConfig(**{**TC.model_dump(), "capacity": CapacityProfile(startup_s=30.0, typical_output_tokens=200)})
    assert tier_capacity(told).startup_s == 30.0 and told.sim == TC.sim
    assert tier_capacity(told).per_replica_rate < cap.per_replica_rate
    # The output length admission assumes: what the call asked for, else the typical answer.
    assert cap.output_estimate(64) == 64 and cap.output_estimate(None) == 20


def test_admission_from_an_observation_uses_the_estimate_and_the_starting_replicas() -> None:
    cap = tier_capacity(TC)
    cold = obs()
    f = admission_forecast(cold, cap)
    assert f.basis == "cold_start" and f.delay_s == cap.startup_s
    # One replica launched 1 s ago: it serves in start-up - 1 s.
    starting = obs(replicas=Replicas.of([rep("a", "starting", started=NOW - 1.0)]))
    f = admission_forecast(starting, cap)
    assert f.basis == "starting" and f.delay_s == pytest.approx(cap.startup_s - 1.0)
    ready = obs(line=(0, 0, 0, 30), replicas=Replicas.of([rep("a")]))
    d = judge_admission(AdmissionInput(ready, cap, Priority.background, prompt_tokens=100,
                                       output_tokens=cap.output_estimate(None), wait_limit_s=1.0, deadline_s=None))
    assert not d.admitted and d.reason == "drain_exceeded" and d.ahead == 30
    d = judge_admission(AdmissionInput(ready, cap, Priority.committed, prompt_tokens=100, output_tokens=20,
                                       wait_limit_s=1.0, deadline_s=60.0))
    assert d.admitted and d.ahead == 0  # nothing of its class or higher ahead
    spent = obs(replicas=Replicas.of([rep("a")]), budget=BudgetSignal(exhausted=True, retry_at=NOW + 90))
    d = judge_admission(AdmissionInput(spent, cap, Priority.speculative, prompt_tokens=1, output_tokens=1,
                                       wait_limit_s=9, deadline_s=None))
    assert d.reason == "budget_exhausted" and d.retry_after_s == 90


def test_scaling_state_counts_replicas_by_state() -> None:
    o = obs(line=(0, 12, 0, 0), oldest_wait_s=3.0, completions_in_window=10, arrivals_in_window=40,
            replicas=Replicas.of([rep("a"), rep("b"), rep("c", "starting"), rep("d", "draining")]))
    s = scaling_state(o, tier_capacity(TC), budget_ceiling=None, calm_since=None)
    assert (s.ready, s.starting, s.draining, s.waiting) == (2, 1, 1, 12)
    assert (s.arrival_rate, s.service_rate) == (4.0, 1.0)
    assert decide_tier(s, TC, NOW).reason == "hold: 1 starting"  # the starting one is counted, not reordered


def test_the_scale_in_victim_is_idle_and_young_and_never_starting() -> None:
    members = [rep("old-idle", started=NOW - 500), rep("young-idle", started=NOW - 50),
               rep("busy", in_use=3, started=NOW - 10), rep("new", "starting", started=NOW - 1),
               rep("going", "draining")]
    assert [r.id for r in scale_in_victims(members, 1)] == ["young-idle"]
    assert [r.id for r in scale_in_victims(members, 3)] == ["young-idle", "old-idle", "busy"]
    assert [r.id for r in scale_in_victims(members, 1, eligible={"busy", "new"})] == ["busy"]
    assert scale_in_victims(members, 1, eligible=set()) == []


def test_fail_safe_ceilings() -> None:
    assert budget_ceiling_for(3, True, True, 5) == 3
    assert budget_ceiling_for(None, True, True, 5) is None  # judged: the budget does not bound
    assert budget_ceiling_for(None, False, True, 5) == 5  # budget unknown: keep what runs, add nothing
    assert budget_ceiling_for(None, False, False, 5) is None  # no budget to know
    assert gpu_ceiling(3, 1, 2) == 6 and gpu_ceiling(3, 1, None) is None
    assert tier_has_budget(TierConfig(hourly_usd=1.0, budget={"daily_usd": 10}))
    assert not tier_has_budget(TierConfig(hourly_usd=0.0, budget={"daily_usd": 10}))


def test_token_burn_is_measured_over_the_last_full_minute() -> None:
    now = 1_800_000_030.0  # 30 s into a minute
    assert token_burn_since(now) == 1_800_000_030.0 - 30 - 60
    assert token_burn_usd_per_s(9.0, now) == pytest.approx(0.1)  # $9 over 90 s


def _saturated(ready: int, served: int, *, since: float | None) -> tuple[TierObservation, Calibration]:
    o = obs(line=(0, 40, 0, 0), oldest_wait_s=12.0, completions_in_window=served,
            replicas=Replicas.of([rep(f"r{i}") for i in range(ready)]))
    return o, Calibration(startup_s=3.0, ready=ready, ready_since=since)


def test_calibration_corrects_throughput_both_ways_only_on_a_saturated_steady_window() -> None:
    model = tier_capacity(TC).per_replica_rate
    slow, prev = _saturated(2, round(2 * model * 10 / 4), since=NOW - 60)  # a quarter of the model, for 60 s
    cal = calibrate(prev, TC, slow)
    assert cal.rate_factor == pytest.approx(0.25, rel=0.02)
    assert calibrated_capacity(TC, cal).per_replica_rate == pytest.approx(model * cal.rate_factor)
    fast, prev = _saturated(2, round(2 * model * 10 * 1.5), since=NOW - 60)
    assert calibrate(prev, TC, fast).rate_factor == pytest.approx(1.5, rel=0.02)  # up as well as down
    # Ready replicas that just changed (one came up 3 s ago) do not measure the engine.
    _, fresh = _saturated(2, 1, since=NOW - 3)
    assert calibrate(fresh, TC, slow).rate_factor == 1.0
    # Nor does a line that is not saturated; the last calibration then stands.
    idle = obs(line=(0, 0, 0, 0), completions_in_window=1, replicas=Replicas.of([rep("a"), rep("b")]))
    assert calibrate(cal, TC, idle).rate_factor == cal.rate_factor


def test_calibration_of_the_start_up() -> None:
    first = initial_calibration(TC)
    assert first.startup_s == 3.0
    beats = obs(replicas=Replicas.of([rep("a", cold=8.0), rep("b", cold=10.0)]))
    assert calibrate(first, TC, beats).startup_s == 9.0  # the engines' own, median
    launched = obs(replicas=beats.replicas, startups_measured=(12.0,))
    assert calibrate(first, TC, launched).startup_s == 12.0  # launch to ready, measured by the supervisor, wins
    assert calibrate(first, TC, obs(), at_least_s=40.0).startup_s == 40.0  # a start timed out after 40 s


def test_config_refuses_a_lease_not_above_the_heartbeat(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = TEST_CONFIG.read_text()
    assert "lease_s: 1.0" in text and "heartbeat_s: 0.25" in text
    bad = tmp_path / "fleet.yaml"
    bad.write_text(text.replace("heartbeat_s: 0.25", "heartbeat_s: 1.0", 1))
    with pytest.raises(ConfigError, match=r"tiers\.routing\.lease_s \(1\) must be above heartbeat_s \(1\)"):
        load_config(bad)


def _serving(in_use: int, completions: int, *, n: int = 2) -> TierObservation:
    # n ready replicas holding `in_use` calls between them, no line: not saturated.
    per = [in_use // n + (1 if i < in_use % n else 0) for i in range(n)]
    return obs(completions_in_window=completions, replicas=Replicas.of([rep(f"r{i}", in_use=u) for i, u in
                                                                        enumerate(per)]))


def test_calibration_reads_the_service_time_by_littles_law_without_saturation() -> None:
    cap = tier_capacity(TC)
    typical = cap.service_s(cap.typical_prompt_tokens, cap.typical_output_tokens, 2)  # batch 2 per replica
    steady = Calibration(startup_s=3.0, ready=2, ready_since=NOW - 60)
    # 4 calls in service, completing at a rate that makes each last twice the model's time: calls
    # twice as long as the typical shape (a long-answer stretch of a trace), with no line at all.
    slow = _serving(4, round(4 / (2 * typical) * 10))
    cal = calibrate(steady, TC, slow)
    assert cal.rate_factor == pytest.approx(0.5, rel=0.05) and cal.measured_at == NOW
    # The short-answer stretch that follows corrects it up, part-way per reading (smoothed).
    fast = _serving(4, round(4 / (typical / 2) * 10))
    up = calibrate(cal, TC, dataclasses.replace(fast, now=NOW + 10))
    assert cal.rate_factor < up.rate_factor < 2.0
    # Too few completions say nothing; nor does a tier whose ready count just changed.
    assert calibrate(steady, TC, _serving(4, 5)).rate_factor == 1.0
    fresh = Calibration(startup_s=3.0, ready=1, ready_since=NOW - 60)  # was 1 ready, now 2
    assert calibrate(fresh, TC, slow).rate_factor == 1.0
