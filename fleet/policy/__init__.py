"""The policy: pure functions of an observed state and the config.

No I/O and no clock of its own: the gateway, the scaler and the simulator pass
in what they observed (and the time) and execute what comes back. One copy of
the math, so the live fleet and its replay cannot disagree. Import from here:

- `capacity`: the autoscaling exercise's functions and the meters.
- `admission`: join the line or be refused (drain, deadline, budget), and the
  service forecast it rests on.
- `tier_budget`: the tier budget governor (windows, projected spend, the budget
  ceiling, exhausted or not, cost per useful token).
- `scaling`: the tier decision (scale out, in, hold, capped, with its reason)
  and the pre-warm windows.
"""

from fleet.policy.admission import (
    Decision,
    ServiceForecast,
    admit,
    expected_service_s,
    expected_startup_s,
    format_duration,
    predicted_wait_s,
    queue_wait_s,
    replica_concurrency,
    service_batch,
    service_forecast,
)
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
from fleet.policy.prewarm import Prewarm, PrewarmOrder, active_prewarm, prewarm_lead_s
from fleet.policy.scaling import (
    ScaleDecision,
    TierState,
    ceiling_of,
    decide_tier,
    effective_per_replica_rate,
    start_timeout_s,
    wedged,
)
from fleet.policy.tier_budget import (
    BudgetObservation,
    BudgetView,
    active_windows,
    budget_ceiling,
    cost_per_useful_million,
    judge,
    projected_spend,
)

__all__ = [
    "BudgetObservation",
    "BudgetView",
    "Decision",
    "Prewarm",
    "PrewarmOrder",
    "ScaleDecision",
    "ServiceForecast",
    "TierState",
    "active_prewarm",
    "active_windows",
    "admit",
    "backlog_during_startup",
    "budget_ceiling",
    "ceiling_of",
    "cost_per_million_tokens",
    "cost_per_useful_million",
    "decide",
    "decide_tier",
    "effective_per_replica_rate",
    "expected_service_s",
    "expected_startup_s",
    "format_duration",
    "judge",
    "littles_law",
    "predicted_wait_s",
    "prewarm_lead_s",
    "projected_spend",
    "queue_wait_s",
    "rate",
    "replica_concurrency",
    "replicas_for",
    "seconds_to_drain",
    "service_batch",
    "service_forecast",
    "start_timeout_s",
    "startup_seconds",
    "wedged",
]
