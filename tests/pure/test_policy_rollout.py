"""The rollout policy, pure: one new replica at a time, an old one drained only once a new one
is ready, the ready never below the floor, a canary held; and the verdict on a promotion."""

from __future__ import annotations

from fleet.model_config import RolloutConfig
from fleet.policy import ObservedReplica, VersionStats, drain_first, judge_rollout, p99, rollout_step


def rep(rid: str, version: str, state: str = "ready", in_use: int = 0, started: float = 0.0) -> ObservedReplica:
    return ObservedReplica(rid, state, 4, in_use, started, version=version)


def test_a_rollout_replaces_one_replica_at_a_time_and_never_goes_below_the_floor() -> None:
    # Two old ready, the scaler wants two: start one new (the surge).
    fleet = [rep("a", "v1"), rep("b", "v1")]
    assert rollout_step(fleet, "v2", floor=2, target=2).action == "start"
    # It is starting: wait, whatever else holds.
    fleet.append(rep("n1", "v2", "starting"))
    assert rollout_step(fleet, "v2", floor=2, target=2).action == "wait"
    # Ready: drain the old one with least in flight.
    fleet[2] = rep("n1", "v2")
    fleet[0] = rep("a", "v1", in_use=3)
    step = rollout_step(fleet, "v2", floor=2, target=2)
    assert step.action == "drain" and step.replica == "b"
    # Drained: three active again? No, two; start the next.
    fleet[1] = rep("b", "v1", "draining")
    assert rollout_step(fleet, "v2", floor=2, target=2).action == "start"
    fleet += [rep("n2", "v2")]
    assert rollout_step(fleet, "v2", floor=2, target=2).replica == "a"
    fleet[0] = rep("a", "v1", "draining")
    assert rollout_step(fleet, "v2", floor=2, target=2).action == "done"


def test_the_floor_holds_when_there_is_no_surplus_and_a_canary_stops_the_rollout() -> None:
    # At the floor with a new one ready but nothing above target: start, never drain.
    fleet = [rep("a", "v1"), rep("n1", "v2")]
    assert rollout_step(fleet, "v2", floor=2, target=2).action == "start"
    # Above target, but draining would leave fewer ready than the floor.
    fleet = [rep("a", "v1"), rep("b", "v1", "starting"), rep("n1", "v2")]
    step = rollout_step(fleet, "v2", floor=2, target=2)
    assert step.action == "drain" and step.replica == "b"  # a starting old one goes first: no ready lost
    fleet = [rep("a", "v1"), rep("n1", "v2"), rep("x", "v1", "draining")]
    assert rollout_step(fleet, "v2", floor=2, target=1).action == "wait"  # 2 ready, floor 2: keep both
    # Canary of one: one new runs, the old stay until the verdict.
    fleet = [rep("a", "v1"), rep("b", "v1"), rep("n1", "v2")]
    assert rollout_step(fleet, "v2", floor=2, target=3, canary=1).action == "wait"
    # Replicas another supervisor manages are not drained by this one.
    fleet = [rep("a", "v1"), rep("b", "v1"), rep("n1", "v2")]
    assert rollout_step(fleet, "v2", floor=1, target=2, eligible={"n1"}).action == "done"


def test_a_scale_in_during_a_rollout_takes_an_old_replica_first() -> None:
    fleet = [rep("a", "v1"), rep("n1", "v2"), rep("n2", "v2")]
    assert drain_first(fleet, "v2", {"a", "n1", "n2"}) == {"a"}
    assert drain_first(fleet, "v2", {"n1", "n2"}) == {"n1", "n2"}


def test_the_verdict_rolls_back_a_worse_version_and_keeps_one_that_is_not() -> None:
    cfg = RolloutConfig(judge_window_s=60, min_calls=10, max_error_ratio=2.0, error_rate_floor=0.01,
                        max_ttft_p99_ratio=1.5)
    old = VersionStats(calls=100, errors=1, ttft_p99_s=0.10)
    slow = judge_rollout(VersionStats(20, 0, 0.40), old, cfg, elapsed_s=10)
    assert slow.verdict == "rollback" and slow.code == "ttft_p99" and "0.400 s > 0.150 s" in slow.reason
    failing = judge_rollout(VersionStats(20, 3, 0.10), old, cfg, elapsed_s=10)
    assert failing.verdict == "rollback" and failing.code == "error_rate"
    assert judge_rollout(VersionStats(5, 5, 1.0), old, cfg, elapsed_s=10).verdict == "wait"  # too few yet
    assert judge_rollout(VersionStats(20, 0, 0.14), old, cfg, elapsed_s=10).verdict == "wait"
    kept = judge_rollout(VersionStats(20, 0, 0.14), old, cfg, elapsed_s=61)
    assert kept.verdict == "keep" and kept.code == "window_passed"
    assert judge_rollout(VersionStats(3, 0, 0.1), old, cfg, elapsed_s=61).code == "too_few_calls"
    # Nothing known of the old version: the error-rate floor alone.
    assert judge_rollout(VersionStats(20, 0, 9.0), VersionStats(0, 0, None), cfg, 10).verdict == "wait"
    assert judge_rollout(VersionStats(20, 1, 0.1), VersionStats(0, 0, None), cfg, 10).verdict == "rollback"


def test_p99_is_the_nearest_rank() -> None:
    assert p99([]) is None
    assert p99([0.5]) == 0.5
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 11)]) == 10.0


def test_version_stats_count_one_version_since_a_time() -> None:
    from fleet.policy import Outcome, version_stats

    calls = [Outcome(10.0, "v1", True, 0.1), Outcome(11.0, "v2", True, 0.5), Outcome(12.0, "v2", False, None),
             Outcome(13.0, "v1", False, None), Outcome(14.0, "v2", True, 0.3)]
    s = version_stats(calls, "v2", since=11.5)
    assert (s.calls, s.errors, s.ttft_p99_s) == (2, 1, 0.3)
    assert version_stats(calls, "v1", since=0) == VersionStats(2, 1, 0.1)
    assert version_stats(calls, "v3", since=0) == VersionStats(0, 0, None)
