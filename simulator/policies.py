"""What the simulator asks a policy, and our policy: the fleet's own functions, called as live.

A `SimPolicy` answers three questions, on what the simulator observed (a
`fleet.policy.TierObservation`, the shape the live readers build from Redis)
and the tier's config; it never sees the simulator itself:

- how many replicas a tier starts with (`initial_replicas`);
- whether a call joins the line (None) or is shed, and why (`admit`; asked only
  of a policy that `sheds`);
- what a tier should do at a scaler tick (`scale`).

`OurPolicy` answers them with `fleet.policy` itself: `judge_admission` (as the
gateway calls it) and `plan_tier` (as the scaler calls it). It is an adapter:
it fills their inputs from the replay and keeps each tier's `PlanState`.
Nothing of the policy is copied here.
The baselines (`simulator.baselines`) answer the same questions the way other
autoscalers do.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.config import Priority, TierConfig
from fleet.policy import (
    AdmissionDecision,
    AdmissionInput,
    PlanInput,
    PlanState,
    PrewarmOrder,
    TierCapacity,
    TierObservation,
    calibrated_capacity,
    judge_admission,
    plan_tier,
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
    # Whether its gateway reads the caller's clock, joins retries and spends a retry budget
    # (`client_clock`, docs/client-clock.md; `simulator.clients`). Off: every attempt is a new
    # call, and one whose caller left runs on for nobody.
    client_clock = False

    def prepare(self, sc: Scenario) -> None:
        """Called once before the replay: what the policy may know of the scenario beforehand."""

    def initial_replicas(self, tc: TierConfig) -> int:
        return tc.warm_floor

    def admit(self, obs: TierObservation, tc: TierConfig, priority: Priority, prompt_tokens: int,
              deadline_s: float) -> str | None:
        return None

    def decide(self, obs: TierObservation, tc: TierConfig, priority: Priority, prompt_tokens: int,
               deadline_s: float, *, patience_s: float | None = None, opens_chain: bool = False) -> AdmissionDecision:
        """The whole decision (why, Retry-After, final) for a caller whose SDK reads it."""
        return AdmissionDecision(True, None, 0.0, deadline_s, 0, 0, "admitted")

    def scale(self, obs: TierObservation, tc: TierConfig, *, gpu_room: int | None = None) -> Action:
        """`gpu_room`: more replicas of the tier the replay's free GPUs hold (None: no limit);
        a start beyond it does not happen, whatever the policy asks."""
        return Action("hold", 0, "hold", "hold")


_PRIORITIES = tuple(Priority)

# What the replay has that the live scaler reads from Redis: a scenario carries no
# operator pre-warm orders (`fleet prewarm`); its scheduled windows are in the tier
# config, which the plan reads. Its GPU room is its own (`simulator.gpus`).
NO_ORDERS: tuple[PrewarmOrder, ...] = ()


class OurPolicy(SimPolicy):
    """Fleet Gateway's policy: admission, calibration and tier decision from `fleet.policy`."""

    name = "fleet"
    sheds = True
    client_clock = True

    def __init__(self) -> None:
        self.tick_s = 1.0
        self.plans: dict[str, PlanState] = {}  # each tier's calibration and calm, tick to tick
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
        d = self.decide(obs, tc, priority, prompt_tokens, deadline_s)
        return None if d.admitted else d.reason

    def decide(self, obs: TierObservation, tc: TierConfig, priority: Priority, prompt_tokens: int,
               deadline_s: float, *, patience_s: float | None = None, opens_chain: bool = False) -> AdmissionDecision:
        """`judge_admission` as the gateway asks it: `deadline_s` the bound judged (on the caller's
        clock, `CallClock.judged_ms`), its patience across retries, whether it opens a chain."""
        cap = self._capacity(obs.tier, tc)
        return judge_admission(AdmissionInput.for_tier(obs, cap, tc, priority, prompt_tokens=prompt_tokens,
                                                       output_tokens=cap.output_estimate(None), deadline_s=deadline_s,
                                                       patience_s=patience_s, opens_chain=opens_chain))

    def scale(self, obs: TierObservation, tc: TierConfig, *, gpu_room: int | None = None) -> Action:
        """As the live scaler's tick (`scaler.loop.Scaler.tick_tier`): `plan_tier` on what the
        replay observed; the calibrated capacity is kept for admission, as the scaler publishes it."""
        plan = plan_tier(PlanInput(obs, tc, self.tick_s, NO_ORDERS, gpu_room),
                         self.plans.get(obs.tier, PlanState()))
        self.plans[obs.tier] = plan.state
        self.capacity[obs.tier] = plan.capacity
        d = plan.decision
        return Action(d.action, d.delta, d.reason, d.code, d.floor, d.ceiling)


class NoClockPolicy(OurPolicy):
    """Our policy with the caller's clock off (`client_clock.enabled: false`, the fleet before
    issue 37): deadlines are X-Deadline-Ms or the default, retries are new calls, no retry budget,
    no new chain shed first, and a call whose caller left runs on for nobody."""

    name = "fleet-noclock"
    client_clock = False
