"""Durations as people write them: '45m', '90s', '1h30m', '2h', or seconds.

One parser for the command line (`fleet prewarm --for`), the pre-warm API and
scenario files.
"""

from __future__ import annotations

import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def duration_s(text: str) -> float:
    """'45m', '90s', '1h30m', '2h' or a bare number of seconds -> seconds (>= 0)."""
    t = text.strip().lower().replace(" ", "")
    try:
        secs = float(t)
    except ValueError:
        parts = _PART.findall(t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise ValueError(f"not a duration: {text!r} (use e.g. 45m, 90s, 1h30m)") from None
        secs = sum(float(n) * _UNITS[u] for n, u in parts)
    if secs < 0:
        raise ValueError(f"duration must not be negative, got {text!r}")
    return secs


def parse_duration(text: str) -> float:
    """A duration that must be positive (a pre-warm's length)."""
    secs = duration_s(text)
    if secs <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return secs
