"""Cron instants for the pre-warm and budget windows, without parsing a cron at every tick.

The scaler and the simulator ask, every tick, when a window's cron last fired or
next fires. Parsing the expression costs more than the rest of a tick, and its
answer changes once a day at most, so:

- each expression is parsed once (per thread: a `croniter` is moved to each
  query's instant, which is what a new one at that instant computes);
- each answer is remembered with the span of instants it holds for: the first
  firing after any instant in [t, next) is `next`, and the last firing before
  any instant in (prev, next of prev] is `prev`. A later tick inside the span
  is answered without croniter.

Each answer is the one `croniter(cron, instant)` gives (tests/pure compares them).
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter

_local = threading.local()
MAX_REMEMBERED = 4096  # expressions and zones are few; a long-lived process stays bounded


def _memo(name: str) -> dict[Any, Any]:
    """This thread's memo `name` (a `croniter` is moved by each query, so none is shared)."""
    memo = getattr(_local, name, None)
    if memo is None or len(memo) > MAX_REMEMBERED:
        memo = {}
        setattr(_local, name, memo)
    return memo


def _parsed(cron: str) -> croniter:
    """The expression, parsed once."""
    iters = _memo("iters")
    it = iters.get(cron)
    if it is None:
        it = iters[cron] = croniter(cron, 0.0)
    return it


def next_start(cron: str, after: float, tz: str = "UTC") -> float:
    """The first firing of `cron`, read in zone `tz`, strictly after `after` (epoch seconds)."""
    spans = _memo("next")
    key = (cron, tz)
    hit = spans.get(key)
    if hit is not None and hit[0] <= after < hit[1]:
        return hit[1]
    start = _parsed(cron).get_next(float, start_time=datetime.fromtimestamp(after, ZoneInfo(tz)))
    spans[key] = (after, start)
    return start


def next_after(cron: str, base: datetime) -> float:
    """The first firing of `cron` strictly after `base` (an aware datetime), epoch seconds."""
    spans = _memo("next_dt")
    key = (cron, base.tzinfo)
    t = base.timestamp()
    hit = spans.get(key)
    if hit is not None and hit[0] <= t < hit[1]:
        return hit[1]
    start = _parsed(cron).get_next(datetime, start_time=base).timestamp()
    spans[key] = (t, start)
    return start


def prev_before(cron: str, base: datetime) -> float:
    """The last firing of `cron` strictly before `base` (an aware datetime), epoch seconds."""
    spans = _memo("prev")
    key = (cron, base.tzinfo)
    t = base.timestamp()
    hit = spans.get(key)
    if hit is not None and hit[0] < t <= hit[1]:
        return hit[0]
    it = _parsed(cron)
    prev = it.get_prev(datetime, start_time=base)
    after = it.get_next(datetime, start_time=prev).timestamp()
    prev_t = prev.timestamp()
    # Remembered only where croniter agrees with itself (its next firing after `prev` is past
    # `base`): near a change of clocks it may skip an hour, and then it is asked every time.
    if prev_t < t <= after:
        spans[key] = (prev_t, after)
    return prev_t
