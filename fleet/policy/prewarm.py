"""Pre-warm: raise a tier's floor ahead of a known burst, so it pays the cold-start tax in the quiet.

Two sources, one rule: the config's scheduled windows (a cron start and a
duration, read in the tier's time zone, opening early by the expected
start-up) and the operator's orders (a floor until a time). The highest floor
in force wins. Pure; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

from croniter import croniter

from fleet.config import PrewarmWindow


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
    source: str | None  # "schedule <cron>" or "operator"


def window_active(w: PrewarmWindow, now: float, lead_s: float, tz: str = "UTC") -> float | None:
    """When the window covering `now` ends, or None. A window starting at S covers
    [S - lead_s, S + duration_s): it opens early by the start-up time, so replicas
    are resident when the load arrives, and pays the cold-start tax in the quiet.

    `tz` is the zone the cron is read in (a market opens at 08:25 local time).
    """
    zone = ZoneInfo(tz)
    # Only starts after now - duration can still cover now, and the first of them covers
    # it if any does (it ends after now; it only has to have opened, lead included).
    start = croniter(w.cron, datetime.fromtimestamp(now - w.duration_s, zone)).get_next(float)
    return start + w.duration_s if start - lead_s <= now else None


def scheduled_spans(windows: Sequence[PrewarmWindow], begin: float, end: float,
                    tz: str = "UTC") -> list[tuple[float, float, int]]:
    """Every scheduled window that overlaps [begin, end) (epoch seconds), as (start, end, floor),
    without the lead: the floor the operator asked to have resident from each start. The
    simulator's clairvoyant bound holds any schedule to these floors, as the policy is held."""
    zone = ZoneInfo(tz)
    out: list[tuple[float, float, int]] = []
    for w in windows:
        it = croniter(w.cron, datetime.fromtimestamp(begin - w.duration_s, zone))
        while (start := it.get_next(float)) < end:
            if start + w.duration_s > begin:
                out.append((start, start + w.duration_s, w.floor))
    return out


def prewarm_lead_s(startup_s: float, tick_s: float) -> float:
    """How early a pre-warm starts: the expected start-up plus two scaler ticks, so the
    replicas are resident, not starting, when the window opens."""
    return startup_s + 2 * tick_s


def active_prewarm(windows: Sequence[PrewarmWindow], orders: Iterable[PrewarmOrder], now: float, lead_s: float,
                   tz: str = "UTC") -> Prewarm:
    """The highest pre-warm floor in force at `now`, from the schedule and the operator."""
    best = Prewarm(0, None, None)
    for w in windows:
        until = window_active(w, now, lead_s, tz)
        if until is not None and w.floor > best.floor:
            best = Prewarm(w.floor, until, f"schedule {w.cron}")
    for o in orders:
        if o.until > now and o.floor > best.floor:
            best = Prewarm(o.floor, o.until, "operator")
    return best
