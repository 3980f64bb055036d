"""Pre-warm: raise a tier's floor ahead of a known burst, so it pays the cold-start tax in the quiet.

Two sources, one rule: the config's scheduled windows and the operator's orders
(a floor until a time). The highest floor in force wins. A window is read in the
tier's time zone and says either

- `ready_at`: when the capacity must be ready. The replicas start at that time
  less the tier's p95 cold start (the start-ups measured, launch to ready; the
  modelled `startup_seconds` until one is measured) less one scaler tick of
  margin, since the scaler acts at its first tick after the planned start; or
- `cron`: when the window starts. It opens early by the expected (median)
  start-up and two ticks, so the replicas are resident when it starts.

The live scaler and the simulator both reach this rule through
`fleet.policy.plan_tier`; `fleet status` shows each window's plan
(`window_plans`). Pure; no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleet.config import PrewarmWindow
from fleet.policy.cron import next_start

READY_MARGIN_TICKS = 1  # a ready_at window starts this many scaler ticks before its cold start


@dataclass(frozen=True, slots=True)
class PrewarmOrder:
    """An operator's pre-warm: hold the tier at `floor` or more until `until` (epoch seconds)."""

    floor: int
    until: float
    id: str = ""


@dataclass(frozen=True, slots=True)
class Prewarm:
    """The pre-warm floor in force now (0 when none) and where it comes from."""

    floor: int
    until: float | None  # when the floor it sets ends
    source: str | None  # "schedule <cron>", "ready_at <cron>" or "operator"


@dataclass(frozen=True, slots=True)
class ColdStart:
    """The cold start a `ready_at` window plans with, and what it rests on."""

    seconds: float
    measured: int  # how many start-ups it rests on (0: the modelled startup_seconds)
    source: str  # "launch to ready", "replicas' own" or "modelled"

    def describe(self) -> str:
        """How an operator reads it: "p95 of 5 start-ups measured launch to ready, 18.2 s"."""
        if self.measured == 0:
            return f"modelled startup_seconds {self.seconds:.1f} s (no start-up measured yet)"
        return f"p95 of {self.measured} start-ups measured ({self.source}), {self.seconds:.1f} s"


def p95(values: Sequence[float]) -> float:
    """The 95th percentile, linear between the closest ranks (numpy's default); of one value, itself."""
    xs = sorted(values)
    if not xs:
        raise ValueError("p95 of no values")
    pos = 0.95 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def planning_cold_start(measured: Sequence[float], engine_cold_starts: Sequence[float], modelled_s: float,
                        at_least_s: float = 0.0) -> ColdStart:
    """The cold start to plan a `ready_at` window with: the p95 of the start-ups measured
    (launch to ready), else of the replicas' own cold starts, else the modelled
    `startup_seconds`, never less than `at_least_s` (a start that timed out) until one is
    measured. The same sources, in the same order, as the calibration's start-up (which
    takes their median: it plans the typical start; a deadline plans the slow one)."""
    launch = [s for s in measured if s is not None and s >= 0]
    if launch:
        return ColdStart(p95(launch), len(launch), "launch to ready")
    own = [s for s in engine_cold_starts if s is not None and s >= 0]
    if own:
        return ColdStart(p95(own), len(own), "replicas' own")
    return ColdStart(max(0.0, modelled_s, at_least_s), 0, "modelled")


def ready_lead_s(cold: ColdStart, tick_s: float) -> float:
    """How early a `ready_at` window starts its replicas: the cold start and one tick of margin."""
    return cold.seconds + READY_MARGIN_TICKS * tick_s


def prewarm_lead_s(startup_s: float, tick_s: float) -> float:
    """How early a `cron` window opens: the expected start-up plus two scaler ticks, so the
    replicas are resident, not starting, when the window opens."""
    return startup_s + 2 * tick_s


def window_active(w: PrewarmWindow, now: float, lead_s: float, tz: str = "UTC") -> float | None:
    """When the window covering `now` ends, or None. A window at T (its start, or the time its
    replicas must be ready) covers [T - lead_s, T + duration_s): it opens early by `lead_s`,
    so the cold-start tax is paid in the quiet.

    `tz` is the zone the cron is read in (a market opens at 08:30 local time).
    """
    # Only times after now - duration can still cover now, and the first of them covers
    # it if any does (it ends after now; it only has to have opened, lead included).
    start = next_start(w.at, now - w.duration_s, tz)
    return start + w.duration_s if start - lead_s <= now else None


def scheduled_spans(windows: Sequence[PrewarmWindow], begin: float, end: float,
                    tz: str = "UTC") -> list[tuple[float, float, int]]:
    """Every scheduled window that overlaps [begin, end) (epoch seconds), as (start, end, floor),
    without the lead: the floor the operator asked to have resident from each start (or ready
    time). The simulator's clairvoyant bound holds any schedule to these floors, as the policy is held."""
    out: list[tuple[float, float, int]] = []
    for w in windows:
        start = next_start(w.at, begin - w.duration_s, tz)
        while start < end:
            if start + w.duration_s > begin:
                out.append((start, start + w.duration_s, w.floor))
            start = next_start(w.at, start, tz)
    return out


def _lead(w: PrewarmWindow, lead_s: float, ready_lead: float | None) -> float:
    return ready_lead if w.ready_at is not None and ready_lead is not None else lead_s


def active_prewarm(windows: Sequence[PrewarmWindow], orders: Iterable[PrewarmOrder], now: float, lead_s: float,
                   tz: str = "UTC", ready_lead: float | None = None) -> Prewarm:
    """The highest pre-warm floor in force at `now`, from the schedule and the operator. `lead_s`
    opens `cron` windows early (`prewarm_lead_s`); `ready_lead` opens `ready_at` ones
    (`ready_lead_s`; None: `lead_s` too)."""
    best = Prewarm(0, None, None)
    for w in windows:
        until = window_active(w, now, _lead(w, lead_s, ready_lead), tz)
        if until is not None and w.floor > best.floor:
            best = Prewarm(w.floor, until, f"ready_at {w.ready_at}" if w.ready_at is not None else f"schedule {w.cron}")
    for o in orders:
        if o.until > now and o.floor > best.floor:
            best = Prewarm(o.floor, o.until, "operator")
    return best


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """One scheduled window's current or next instance, as the scaler plans it."""

    kind: str  # "ready_at" or "cron"
    cron: str
    floor: int
    at: float  # epoch: when the replicas must be ready (ready_at) or the window starts (cron)
    start: float  # epoch: when the floor rises and the replicas start
    end: float  # epoch: when the floor falls back
    active: bool  # the floor is raised now
    why: str


def window_plans(windows: Sequence[PrewarmWindow], now: float, *, lead_s: float, startup_s: float,
                 cold: ColdStart, tick_s: float, tz: str = "UTC") -> list[WindowPlan]:
    """Each window's instance in force or next to come, with when the scaler starts its
    replicas and why. `lead_s` and `startup_s`: a `cron` window's lead and the expected
    start-up it rests on; `cold`: what a `ready_at` window plans with."""
    out = []
    for w in windows:
        at = next_start(w.at, now - w.duration_s, tz)
        if w.ready_at is not None:
            lead = ready_lead_s(cold, tick_s)
            why = f"ready by then: {cold.describe()}, + {READY_MARGIN_TICKS * tick_s:g} s (one tick) of margin"
        else:
            lead = lead_s
            why = (f"cron start, opened early by the expected start-up {startup_s:.1f} s "
                   f"+ {2 * tick_s:g} s (two ticks)")
        out.append(WindowPlan("ready_at" if w.ready_at is not None else "cron", w.at, w.floor, at, at - lead,
                              at + w.duration_s, at - lead <= now, why))
    return out
