"""The policy: pure functions over one observation type and the config.

No I/O and no clock of its own: the gateway, the scaler, the workers and the
simulator pass in what they observed (a `TierObservation`, with its `now`)
and execute what comes back. One copy of the math, so the live fleet and its
replay cannot disagree; no caller derives a rate, a drain time, a victim or a
ceiling itself. The modules, each importing only those above it:

- `capacity`: the autoscaling exercise's functions and the meters;
- `tier_capacity`: what one replica is assumed to do (`capacity:` profile);
- `replicas`: replicas by state, which one leaves on a scale-in, and their
  health (the start timeout, a wedged replica);
- `admission`: join the line or be refused, and the service forecast;
- `scaling`: the tier decision (scale out, in, hold, capped, with its reason),
  the ceilings and their fail-safes;
- `prewarm`: the pre-warm floor in force;
- `observation`: `TierObservation`, its one builder (`observe_tier`) and the
  derived inputs (rates, drain time, the admission forecast and decision, the
  scaling state);
- `calibration`: capacity expected vs seen (start-up, throughput);
- `plan`: one tier's tick whole (`plan_tier`: calibrate, pre-warm, ceilings,
  decide), the function the scaler and the simulator are adapters around;
- `tier_budget`: the tier budget governor's math (windows, projected spend,
  the budget ceiling, exhausted or not, token burn, cost per useful token);
- `key_budget`: what a call costs an API key;
- `rollout`: replacing replicas by the live model version one at a time, and
  judging a promotion against the version it replaced.
- `preemption`: which running request gives its slot to a higher class, and the
  slots a replica keeps for higher classes;
- `claim`: what one free slot of a replica takes from the line (class order, the
  caps of its reserved slots, the affinity hold, due calls never passed over): the
  rule the line's Lua claims apply and the simulator calls for every take.
"""

from fleet.policy.admission import (
    AdmissionDecision,
    ServiceForecast,
    admit,
    format_duration,
    predicted_wait_s,
    queue_wait_s,
    service_forecast,
    wait_with_ceiling_s,
)
from fleet.policy.calibration import (
    Calibration,
    calibrate,
    calibrated_capacity,
    initial_calibration,
    startup_estimate,
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
from fleet.policy.claim import Holder, HoldRules, ReplicaView, Take, Waiting, caps_of, choose_take
from fleet.policy.observation import (
    AdmissionInput,
    BudgetSignal,
    TierObservation,
    admission_forecast,
    ahead_of,
    arrival_rate,
    budget_signal,
    drain_s,
    judge_admission,
    observe_tier,
    scaling_state,
    service_rate,
    waiting,
)
from fleet.policy.plan import PlanInput, PlanState, TierPlan, plan_tier, with_start_timeout, with_startup
from fleet.policy.preemption import (
    RunningRequest,
    WaitingRequest,
    choose_victim,
    claim_caps,
    preemptible_below,
    victim_rank,
)
from fleet.policy.prewarm import Prewarm, PrewarmOrder, active_prewarm, prewarm_lead_s
from fleet.policy.replicas import ObservedReplica, Replicas, scale_in_victims, start_timeout_s, wedged
from fleet.policy.rollout import (
    Outcome,
    RolloutStep,
    Verdict,
    VersionStats,
    drain_first,
    judge_rollout,
    p99,
    replicas_by_version,
    rollout_step,
    version_stats,
)
from fleet.policy.scaling import (
    ScaleDecision,
    TierState,
    budget_ceiling_for,
    ceiling_of,
    decide_tier,
    gpu_ceiling,
    line_need,
    rate_with_margin,
)
from fleet.policy.tier_budget import (
    BudgetObservation,
    BudgetView,
    active_windows,
    budget_ceiling,
    cost_per_useful_million,
    judge,
    projected_spend,
    tier_has_budget,
    token_burn_since,
    token_burn_usd_per_s,
)
from fleet.policy.tier_capacity import (
    TierCapacity,
    default_max_tokens,
    modelled_startup_s,
    replica_concurrency,
    tier_capacity,
)

__all__ = [
    "AdmissionDecision",
    "AdmissionInput",
    "BudgetObservation",
    "BudgetSignal",
    "BudgetView",
    "Calibration",
    "HoldRules",
    "Holder",
    "ObservedReplica",
    "Outcome",
    "PlanInput",
    "PlanState",
    "Prewarm",
    "PrewarmOrder",
    "ReplicaView",
    "Replicas",
    "RolloutStep",
    "RunningRequest",
    "ScaleDecision",
    "ServiceForecast",
    "Take",
    "TierCapacity",
    "TierObservation",
    "TierPlan",
    "TierState",
    "Verdict",
    "VersionStats",
    "Waiting",
    "WaitingRequest",
    "active_prewarm",
    "active_windows",
    "admission_forecast",
    "admit",
    "ahead_of",
    "arrival_rate",
    "backlog_during_startup",
    "budget_ceiling",
    "budget_ceiling_for",
    "budget_signal",
    "calibrate",
    "calibrated_capacity",
    "caps_of",
    "ceiling_of",
    "choose_take",
    "choose_victim",
    "claim_caps",
    "cost_per_million_tokens",
    "cost_per_useful_million",
    "decide",
    "decide_tier",
    "default_max_tokens",
    "drain_first",
    "drain_s",
    "format_duration",
    "gpu_ceiling",
    "initial_calibration",
    "judge",
    "judge_admission",
    "judge_rollout",
    "line_need",
    "littles_law",
    "modelled_startup_s",
    "observe_tier",
    "p99",
    "plan_tier",
    "predicted_wait_s",
    "preemptible_below",
    "prewarm_lead_s",
    "projected_spend",
    "queue_wait_s",
    "rate",
    "rate_with_margin",
    "replica_concurrency",
    "replicas_by_version",
    "replicas_for",
    "rollout_step",
    "scale_in_victims",
    "scaling_state",
    "seconds_to_drain",
    "service_forecast",
    "service_rate",
    "start_timeout_s",
    "startup_estimate",
    "startup_seconds",
    "tier_capacity",
    "tier_has_budget",
    "token_burn_since",
    "token_burn_usd_per_s",
    "version_stats",
    "victim_rank",
    "wait_with_ceiling_s",
    "waiting",
    "wedged",
    "with_start_timeout",
    "with_startup",
]
