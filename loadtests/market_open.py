"""The market-open burst as a Locust LoadTestShape, compressed in time.

A trading desk's agent fleet, 08:00 to 09:30 (market time):

    quiet      08:00-08:25  overnight digestion, a trickle of work
    pre-warm   08:25-08:30  the fleet raises its floors; load starts to stir
    open       08:30-08:35  the open: every agent wakes at once
    digestion  08:35-09:00  the first prints being worked through
    echo       09:00-09:05  a second wave (09:00 data releases, re-plans)
    return     09:05-09:30  back towards quiet

The 90 market minutes run in LOADTEST_DURATION_S real seconds (default 180),
or at LOADTEST_TIME_SCALE market seconds per real second if that is set.
LOADTEST_PEAK_USERS (default 40) is the user count at the open; the other
phases are fractions of it.

Use it next to the users: `locust -f loadtests/locustfile.py,loadtests/market_open.py`.
"""

from __future__ import annotations

import logging
import os

from locust import LoadTestShape

try:  # run by locust, which puts this folder on sys.path
    from phases import phase_at, time_scale
except ImportError:  # imported as a package (the tests)
    from loadtests.phases import phase_at, time_scale

log = logging.getLogger("loadtest.shape")


class MarketOpen(LoadTestShape):
    def __init__(self) -> None:
        super().__init__()
        self.scale = time_scale()
        self.peak = int(os.environ.get("LOADTEST_PEAK_USERS", "40"))
        self.phase = ""

    def tick(self) -> tuple[int, float] | None:
        now = phase_at(self.get_run_time(), self.scale, self.peak)
        if now is None:
            return None
        name, users = now
        if name != self.phase:
            log.info("market phase %s: %d users", name, users)
            self.phase = name
        # The open arrives at once; other phases ramp within a couple of seconds.
        spawn_rate = float(users if name in ("open", "echo") else max(1, users // 2))
        return users, spawn_rate
