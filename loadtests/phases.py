"""The market-open morning as data: phases, their lengths and loads, and the
compression of market time into a run. Pure, and free of Locust, so the
tests can check it without gevent patching their process."""

from __future__ import annotations

import math
import os

# (phase, market seconds, fraction of peak users)
PHASES: tuple[tuple[str, float, float], ...] = (
    ("quiet", 25 * 60, 0.10),
    ("pre-warm", 5 * 60, 0.20),
    ("open", 5 * 60, 1.00),
    ("digestion", 25 * 60, 0.50),
    ("echo", 5 * 60, 0.80),
    ("return", 25 * 60, 0.15),
)
MARKET_SECONDS = sum(p[1] for p in PHASES)


def time_scale() -> float:
    """Market seconds per real second: LOADTEST_TIME_SCALE, else the morning in LOADTEST_DURATION_S (180)."""
    if os.environ.get("LOADTEST_TIME_SCALE"):
        scale = float(os.environ["LOADTEST_TIME_SCALE"])
    else:
        scale = MARKET_SECONDS / float(os.environ.get("LOADTEST_DURATION_S", "180"))
    if not scale > 0:
        raise ValueError(f"the load test's time scale must be > 0, got {scale}")
    return scale


def phase_at(real_s: float, scale: float, peak: int) -> tuple[str, int] | None:
    """The phase and user count at a real time into the run; None when the morning is over."""
    market = real_s * scale
    for name, length, share in PHASES:
        if market < length:
            return name, max(1, math.ceil(peak * share))
        market -= length
    return None
