"""What the simulator asks a policy, and our policy: the fleet's own functions, called as live.

A `SimPolicy` answers three questions, on what the simulator observed (a
`fleet.policy.TierObservation`, the shape the live readers build from Redis)
and the tier's config; it never sees the simulator itself:

- how many replicas a tier starts with (`initial_replicas`);
- whether a call joins the line (None) or is shed, and why (`admit`; asked only
  of a policy that `sheds`);
- what a tier should do at a scaler tick (`scale`).

`OurPolicy` answers them with `fleet.policy` itself: `judge_admission`,
`calibrate`, `active_prewarm`, `scaling_state` and `decide_tier`, the same
calls the gateway and the scaler make. Nothing of the policy is copied here.
The baselines (`simulator.baselines`) answer the same questions the way other
autoscalers do.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.config import Priority, TierConfig
from fleet.policy import (
    Calibration,
    TierCapacity,
    TierObservation,
    active_prewarm,
    budget_ceiling_for,
    calibrate,
    calibrated_capacity,
    decide_tier,
    initial_calibration,
    judge_admission,
    prewarm_lead_s,
    scaling_state,
    tier_has_budget,
)
from simulator.scenario import Scenario


@dataclass(slots=True)
class Action:
    """A tier decision as the simulator executes and records it. A negative delta drains
    that many replicas, which `fleet.policy.scale_in_victims` picks."""

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

    def prepare(self, sc: Scenario) -> None:
        """Called once before the replay: what the policy may know of the scenario beforehand."""

    def initial_replicas(self, tc: TierConfig) -> int:
        return tc.warm_floor

    def admit(self, obs: TierObservation, tc: TierConfig, priority: Priority, prompt_tokens: int,
              deadline_s: float) -> str | None:
        return None

    def scale(self, obs: TierObservation, tc: TierConfig) -> Action:
        return Action("hold", 0, "hold", "hold")


_PRIORITIES = tuple(Priority)


class OurPolicy(SimPolicy):
    """Fleet Gateway's policy: admission, calibration and tier decision from `fleet.policy`."""

    name = "fleet"
    sheds = True

    def __init__(self) -> None:
        self.tick_s = 1.0
        self.calm_since: dict[str, float | None] = {}
        self.calm_keep: dict[str, int] = {}
        self.calibration: dict[str, Calibration] = {}
        self.capacity: dict[str, TierCapacity] = {}  # as the scaler last published it, for admission

    def prepare(self, sc: Scenario) -> None:
        self.tick_s = sc.spec.tick_s

    def _capacity(self, tier: str, tc: TierConfig) -> TierCapacity:
        cap = self.capacity.get(tier)
        if cap is None:
            cap = self.capacity[tier] = calibrated_capacity(tc, None)
        return cap

    def admit(self, obs: TierObservation, tc: TierConfig, priority: Priority, prompt_tokens: int,
              deadline_s: float) -> str | None:
        """As the gateway's tier decision: the same observation, the same capacity, the same
        output-length estimate (the call's true length is not known before it runs)."""
        cap = self._capacity(obs.tier, tc)
        d = judge_admission(obs, cap, priority, prompt_tokens=prompt_tokens, output_tokens=cap.output_estimate(None),
                            wait_limit_s=tc.wait_limit(priority), deadline_s=deadline_s,
                            max_replicas=tc.max_replicas)
        return None if d.admitted else d.reason

    def scale(self, obs: TierObservation, tc: TierConfig) -> Action:
        """As the live scaler's tick (`scaler.loop.Scaler.tick_tier`): calibrate, then decide."""
        tier = obs.tier
        cal = calibrate(self.calibration.get(tier) or initial_calibration(tc), tc, obs)
        self.calibration[tier] = cal
        cap = self.capacity[tier] = calibrated_capacity(tc, cal)
        pw = active_prewarm(tc.prewarm, [], obs.now, prewarm_lead_s(cap.startup_s, self.tick_s), tc.budget.timezone)
        reps = obs.replicas
        b = obs.budget
        state = scaling_state(obs, cap, prewarm_floor=pw.floor,
                              budget_ceiling=budget_ceiling_for(b.ceiling if b else None, b is not None,
                                                                tier_has_budget(tc), reps.ready + reps.starting),
                              calm_since=self.calm_since.get(tier), calm_keep=self.calm_keep.get(tier, 0))
        d = decide_tier(state, tc, obs.now)
        self.calm_since[tier], self.calm_keep[tier] = d.calm_since, d.calm_keep
        return Action(d.action, d.delta, d.reason, d.code, d.floor, d.ceiling)
