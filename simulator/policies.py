"""What the simulator asks a policy, and our policy: the fleet's own functions, called as live.

A `SimPolicy` answers three questions: how many replicas a tier starts with,
whether a call joins the line (None) or is shed (the reason), and what a tier
should do at a scaler tick. `OurPolicy` answers them with `fleet.policy`
itself: `admission.admit` with `service_forecast`, `scaling.decide_tier` with
`active_prewarm`, and the budget governor `budget.judge`, on a state built
from what the simulator observed, the way the gateway and scaler build it from
Redis. Nothing of the policy is copied here; this module only translates.

The baselines (`simulator.baselines`) answer the same questions the way other
autoscalers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleet.config import Priority, TierConfig
from fleet.policy import (
    ScaleDecision,
    TierState,
    active_prewarm,
    admit,
    decide_tier,
    effective_per_replica_rate,
    expected_service_s,
    expected_startup_s,
    prewarm_lead_s,
    service_batch,
    service_forecast,
)
from fleet.policy.tier_budget import BudgetView

if TYPE_CHECKING:
    from simulator.arrivals import Call
    from simulator.engine import Observation, Simulator, TierSim


@dataclass(slots=True)
class Action:
    """A tier decision as the simulator executes and records it."""

    action: str  # scale_out | scale_in | hold | capped
    delta: int
    reason: str
    reason_kind: str  # a bounded code: consecutive holds with the same code are one timeline entry
    floor: int | None = None
    ceiling: int | None = None


class SimPolicy:
    """The base: start at the warm floor, admit everything, hold."""

    name = "none"
    # Whether the policy sheds by its own admission rule; baselines do not (their calls
    # wait in line until served or until their deadline passes).
    sheds = False

    def initial_replicas(self, sim: Simulator, tier: TierSim) -> int:
        return tier.tc.warm_floor

    def admit(self, sim: Simulator, tier: TierSim, call: Call, deadline_s: float) -> str | None:
        return None

    def scale(self, sim: Simulator, tier: TierSim, obs: Observation) -> Action:
        return Action("hold", 0, "hold", "hold")


def tier_state(tc: TierConfig, obs: Observation, *, rate_window_s: float, prewarm_floor: int,
               budget: BudgetView | None, calm_since: float | None, per_replica_rate: float,
               startup_s: float) -> TierState:
    """The `TierState` of an observation: the same fields the live scaler fills from Redis."""
    per_replica = effective_per_replica_rate(per_replica_rate, obs.service_rate, obs.ready, obs.waiting,
                                             obs.oldest_wait_s, rate_window_s)
    return TierState(
        waiting=obs.waiting, oldest_wait_s=obs.oldest_wait_s, arrival_rate=obs.arrival_rate,
        service_rate=obs.service_rate, ready=obs.ready, starting=obs.starting, per_replica_rate=per_replica,
        startup_s=startup_s, draining=obs.draining, prewarm_floor=prewarm_floor,
        # As the live scaler reads it from the governor's hash: the ceiling, whenever one is published.
        budget_ceiling=budget.ceiling if budget is not None else None,
        gpu_ceiling=None, calm_since=calm_since)


_PRIORITIES = tuple(Priority)


class OurPolicy(SimPolicy):
    """Fleet Gateway's policy: admission, tier decision and budget governor from `fleet.policy`."""

    name = "fleet"
    sheds = True

    def __init__(self) -> None:
        self.calm_since: dict[str, float | None] = {}
        self.constants: dict[str, tuple[int, tuple[float, ...]]] = {}

    def _startup_s(self, tier: TierSim) -> float:
        # Live, the scaler takes the median of the cold starts replicas measured; in
        # simulated time every replica takes exactly the modelled one.
        return expected_startup_s([], tier.cold_start)

    def admit(self, sim: Simulator, tier: TierSim, call: Call, deadline_s: float) -> str | None:
        """As the gateway's tier decision (gateway/admission.py): the line by class, the busy
        spell, completions in the window and while busy, the replicas, the budget state."""
        t = sim.t
        startup = tier.cold_start  # `_startup_s`, without the call: this runs for every arrival
        starting_left = ([max(0.0, r.ready_at - t) for r in tier.replicas if r.state == "starting"]
                         if tier.n_starting else [])
        window = tier.window_s
        busy = min(tier.oldest_wait(t), window) if tier.waiting else 0.0
        forecast = service_forecast(
            ready=tier.n_ready, starting_left_s=starting_left, per_replica_rate=tier.per_replica_rate,
            startup_s=startup, completions_in_window=tier.completions_since(t - window), window_s=window,
            busy_s=busy, completions_while_busy=tier.completions_since(t - busy) if busy > 0 else 0)
        prio = _PRIORITIES[call.cls]
        by_class = tier.by_class
        ahead = by_class[0] if call.cls == 0 else sum(by_class[: call.cls + 1])
        view: BudgetView | None = tier.budget_view
        exhausted = view is not None and view.exhausted
        retry_in = view.retry_at - sim.sc.epoch(t) if exhausted and view is not None and view.retry_at else None
        batch, limits = self._tier_constants(tier)
        d = admit(prio, ahead=ahead, forecast=forecast,
                  service_s=expected_service_s(tier.tc, call.prompt, call.output, batch),
                  wait_limit_s=limits[call.cls], deadline_s=deadline_s, budget_exhausted=exhausted,
                  budget_retry_in_s=retry_in)
        return None if d.admitted else d.reason

    def _tier_constants(self, tier: TierSim) -> tuple[int, tuple[float, ...]]:
        """Per tier, read once from the config: the admission batch and the wait limit by class."""
        c = self.constants.get(tier.name)
        if c is None:
            c = self.constants[tier.name] = (service_batch(tier.tc),
                                             tuple(tier.tc.wait_limit(p) for p in _PRIORITIES))
        return c

    def scale(self, sim: Simulator, tier: TierSim, obs: Observation) -> Action:
        tc = tier.tc
        startup = self._startup_s(tier)
        pw = active_prewarm(tc.prewarm, [], obs.now, prewarm_lead_s(startup, sim.tick_s), tc.budget.timezone)
        state = tier_state(tc, obs, rate_window_s=tier.window_s, prewarm_floor=pw.floor, budget=tier.budget_view,
                           calm_since=self.calm_since.get(tier.name), per_replica_rate=tier.per_replica_rate,
                           startup_s=startup)
        d: ScaleDecision = decide_tier(state, tc, obs.now)
        self.calm_since[tier.name] = d.calm_since
        return Action(d.action, d.delta, d.reason, d.code, d.floor, d.ceiling)

