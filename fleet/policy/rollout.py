"""A rollout: replacing a tier's replicas by the live version, one at a time, and judging it. Pure.

`rollout_step` says what the scaler does next for a rollout while its own
decision holds (a scale-out already starts replicas at the live version,
and a scale-in drains an old one first, `drain_first`): start one new
replica; once it is ready, drain one old one; never let the ready replicas
fall below the floor. It reads only what is observed, so a new leader
resumes a rollout where the last one left it, and no step is taken twice.

`judge_rollout` compares the new version with the one it replaced over the
window after a promotion: worse error rate or TTFT p99 by the configured
factor, and the promotion is undone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from fleet.model_config import RolloutConfig
from fleet.policy.replicas import ObservedReplica

StepAction = Literal["start", "drain", "wait", "done"]


@dataclass(frozen=True, slots=True)
class RolloutStep:
    action: StepAction
    replica: str | None  # the one to drain
    reason: str


def _active(r: ObservedReplica) -> bool:
    return r.state in ("ready", "starting")


def rollout_step(members: Iterable[ObservedReplica], live: str, *, floor: int, target: int,
                 canary: int | None = None, eligible: set[str] | None = None) -> RolloutStep:
    """The next step of a rollout to `live`.

    `target`: the replicas the scaler wants now (its demand within floor and
    ceiling); one more may run while a new one starts (the surge).
    `canary`: stop once this many run the new version (until it is judged).
    `eligible`: the ids the caller may drain (None: any).

    1. A new replica is starting: wait for it (one at a time).
    2. No old replica is active (and the canary, if any, is met): done.
    3. A new one is ready and the tier is above its target: drain one old
       one (a starting one first, else the ready one with least in flight),
       never taking the ready replicas below the floor.
    4. Otherwise (the canary not yet met): start one new replica.
    """
    m = list(members)
    new = [r for r in m if _active(r) and r.version == live]
    old = [r for r in m if _active(r) and r.version != live and (eligible is None or r.id in eligible)]
    ready = sum(r.state == "ready" for r in m)
    new_ready = sum(r.state == "ready" for r in new)
    active = sum(_active(r) for r in m)
    if any(r.state == "starting" for r in new):
        return RolloutStep("wait", None, f"waiting for a replica at {live} to be ready")
    if canary is not None and len(new) >= canary:
        if old:
            return RolloutStep("wait", None, f"canary: {len(new)} replica(s) at {live}, judging before the rest")
        return RolloutStep("done", None, f"every replica runs {live}")
    if not old:
        return RolloutStep("done", None, f"every replica runs {live}")
    if new_ready and active > target:
        starting_old = [r for r in old if r.state == "starting"]
        if starting_old:
            victim = starting_old[0]
        else:
            if ready - 1 < floor:
                return RolloutStep("wait", None, f"draining one more would leave {ready - 1} ready, below the "
                                   f"floor of {floor}")
            victim = min((r for r in old if r.state == "ready"), key=lambda r: (r.in_use, -r.started))
        return RolloutStep("drain", victim.id, f"rollout to {live}: replaces {victim.id} ({victim.version})")
    return RolloutStep("start", None, f"rollout to {live}: one new replica ({len(old)} at older versions left)")


def replicas_by_version(members: Iterable[ObservedReplica], live: str) -> dict[str, dict[str, int]]:
    """Replicas per version and state, every state present; the live version always listed."""
    out: dict[str, dict[str, int]] = {live: {"starting": 0, "ready": 0, "draining": 0}}
    for r in members:
        out.setdefault(r.version, {"starting": 0, "ready": 0, "draining": 0})
        out[r.version][r.state] = out[r.version].get(r.state, 0) + 1
    return out


def drain_first(members: Iterable[ObservedReplica], live: str, eligible: set[str]) -> set[str]:
    """Which replicas a scale-in may pick during a rollout: those at an older version when there
    are any (the rollout would replace them anyway), else all it was allowed."""
    old = {r.id for r in members if r.id in eligible and r.state == "ready" and r.version != live}
    return old or eligible


# --- judging a promotion ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished call, as the worker recorded it."""

    at: float  # epoch seconds (Redis clock)
    version: str
    ok: bool
    ttft_s: float | None  # for an ok call


@dataclass(frozen=True, slots=True)
class VersionStats:
    """One version's calls over the judging window."""

    calls: int  # finished: completed or failed
    errors: int
    ttft_p99_s: float | None  # None: nothing completed


@dataclass(frozen=True, slots=True)
class Verdict:
    verdict: Literal["rollback", "keep", "wait"]
    reason: str
    code: str  # error_rate | ttft_p99 | window_passed | too_few_calls | judging


def version_stats(outcomes: Iterable[Outcome], version: str, since: float) -> VersionStats:
    """`version`'s calls finished at or after `since`: how many, how many failed, the TTFT p99."""
    mine = [o for o in outcomes if o.version == version and o.at >= since]
    return VersionStats(calls=len(mine), errors=sum(not o.ok for o in mine),
                        ttft_p99_s=p99(o.ttft_s for o in mine if o.ok and o.ttft_s is not None))


def judge_rollout(new: VersionStats, old: VersionStats, cfg: RolloutConfig, elapsed_s: float) -> Verdict:
    """Roll back when the new version is worse than the old by the configured factor, on error
    rate or on TTFT p99, once it has finished `min_calls`; keep it when the window passes
    without that; wait otherwise. With nothing measured of the old version, the new one is
    held to the error-rate floor alone."""
    if new.calls >= cfg.min_calls:
        new_err, old_err = new.errors / new.calls, (old.errors / old.calls if old.calls else 0.0)
        bar = max(cfg.error_rate_floor, old_err * cfg.max_error_ratio)
        if new_err > bar:
            return Verdict("rollback", f"error rate {new_err:.1%} > {bar:.1%} (old {old_err:.1%} x "
                           f"{cfg.max_error_ratio:g}, floor {cfg.error_rate_floor:.1%})", "error_rate")
        if new.ttft_p99_s is not None and old.ttft_p99_s is not None and old.calls >= cfg.min_calls:
            bar_s = old.ttft_p99_s * cfg.max_ttft_p99_ratio
            if new.ttft_p99_s > bar_s:
                return Verdict("rollback", f"TTFT p99 {new.ttft_p99_s:.3f} s > {bar_s:.3f} s (old "
                               f"{old.ttft_p99_s:.3f} s x {cfg.max_ttft_p99_ratio:g})", "ttft_p99")
    if elapsed_s >= cfg.judge_window_s:
        if new.calls < cfg.min_calls:
            return Verdict("keep", f"window of {cfg.judge_window_s:g} s passed with {new.calls} call(s), "
                           f"fewer than {cfg.min_calls}: nothing to judge", "too_few_calls")
        return Verdict("keep", f"no worse than the old version over {cfg.judge_window_s:g} s", "window_passed")
    return Verdict("wait", f"judging: {new.calls} call(s) in {elapsed_s:.0f} s", "judging")


def p99(samples: Iterable[float]) -> float | None:
    """The 99th percentile (nearest rank) of the samples; None for none."""
    s = sorted(samples)
    if not s:
        return None
    return s[min(len(s) - 1, max(0, -(-99 * len(s) // 100) - 1))]
