"""The policy: pure functions of an observed state and the config.

No I/O and no clock of its own: the gateway, the scaler and the simulator pass
in what they observed (and the time) and execute what comes back. One copy of
the math, so the live fleet and its replay cannot disagree. Import from here:

- `capacity`: the autoscaling exercise's functions and the meters.
"""

from fleet.policy.capacity import (
    backlog_during_startup,
    cost_per_million_tokens,
    decide,
    littles_law,
    rate,
    replicas_for,
    seconds_to_drain,
    startup_seconds,
)

__all__ = [
    "backlog_during_startup",
    "cost_per_million_tokens",
    "decide",
    "littles_law",
    "rate",
    "replicas_for",
    "seconds_to_drain",
    "startup_seconds",
]
