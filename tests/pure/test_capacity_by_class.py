"""The capacity model counts, per class, the slots the claim lets that class take (decision 0080):
a replica keeping `reserved_slots` for committed runs `slots - 1` calls of the classes below, so
the scaler, admission and calibration plan those classes with `slots - 1`; committed keeps all.
Pure: what `plan_tier` (the live scaler's and the simulator's one tick) and `judge_admission`
(the gateway's and the simulator's) decide."""

from __future__ import annotations

from dataclasses import replace

from fleet.classes import Preemption
from fleet.config import Priority, SimProfile, TierConfig
from fleet.policy import (
    AdmissionInput,
    Calibration,
    ObservedReplica,
    PlanInput,
    PlanState,
    Replicas,
    ReplicaView,
    Waiting,
    admission_forecast,
    calibrate,
    choose_take,
    judge_admission,
    observe_tier,
    plan_tier,
    tier_capacity,
)

NOW = 1_800_000_000.0
# Long calls (about 40 s each): a replica frees a slot rarely, so a line is drained by the
# slots new replicas bring, and one slot more or less a replica changes the order.
LONG = SimProfile(weights_gb=4, load_gb_s=2, warmup_s=1, prefill_tokens_per_s=10000,
                  kv_capacity_tokens=1_000_000, typical_prompt_tokens=1000, typical_output_tokens=2000)
KEPT = TierConfig(slots=4, drain_threshold_s=2.0, max_replicas=20, warm_floor=1, sim=LONG,
                  preemption=Preemption(reserved_slots={"committed": 1}))
OPEN = KEPT.model_copy(update={"preemption": Preemption()})


def test_each_class_has_the_slots_the_claim_lets_it_take() -> None:
    cap = tier_capacity(KEPT)
    assert cap.batch == 4 and cap.class_batch == (4, 3, 3, 3)
    assert cap.rate_of(Priority.committed) == cap.per_replica_rate  # committed may use every slot
    assert cap.rate_of(Priority.interactive) < cap.per_replica_rate
    assert tier_capacity(OPEN).class_batch == (4, 4, 4, 4)  # nothing kept: every slot for every class
    # The model is the claim's own rule: an idle replica, given calls of one class, takes that many.
    for rank in Priority:
        running: tuple[int, ...] = ()
        view = ReplicaView(KEPT.slots, running, {0: 1})
        while choose_take(_line_of(rank), view).call is not None:
            running = (*running, rank)
            view = ReplicaView(KEPT.slots, running, {0: 1})
        assert len(running) == cap.batch_of(rank), rank.name


def _line_of(rank: int) -> list[list[Waiting]]:
    heads: list[list[Waiting]] = [[] for _ in Priority]
    heads[rank] = [Waiting("r", rank, 0.0, 60_000.0)]
    return heads


def _busy(line: tuple[int, int, int, int], ready: int = 1, **kw: object) -> PlanInput:
    """A tier whose `ready` replicas each run 3 calls (their slots less the kept one), `line` waiting."""
    reps = [ObservedReplica(f"r{i}", "ready", 4, 3, NOW - 600) for i in range(ready)]
    obs = observe_tier("t", NOW, 10.0, line=line, oldest_wait_s=5.0, in_flight=3 * ready,
                       replicas=Replicas.of(reps), **kw)  # type: ignore[arg-type]
    return PlanInput(obs=obs, cfg=KEPT, tick_s=1.0, orders=(), gpu_room=None)


def test_the_scaler_orders_seats_for_a_line_below_the_reservation() -> None:
    """12 interactive calls wait, one replica is full: a new replica seats 3 of them, not 4, so
    4 new replicas are needed (counting 4 slots a replica ordered 3, and left 3 calls waiting a
    40 s call's end)."""
    plan = plan_tier(_busy((0, 12, 0, 0)), PlanState())
    assert plan.decision.action == "scale_out"
    assert plan.decision.delta == 4 and plan.decision.delta * 3 >= 12
    # Without the reservation the same line is seated by 3 replicas of 4.
    assert plan_tier(replace(_busy((0, 12, 0, 0)), cfg=OPEN), PlanState()).decision.delta == 3


def test_a_committed_line_is_planned_with_every_slot() -> None:
    """12 committed calls: a new replica seats 4 (the kept slot is theirs), so 3 are enough."""
    plan = plan_tier(_busy((12, 0, 0, 0)), PlanState())
    assert plan.decision.action == "scale_out" and plan.decision.delta == 3


def test_admission_does_not_promise_a_lower_class_the_kept_slot() -> None:
    """One replica runs 3 interactive calls; its free slot is the committed one. An interactive
    call waits for a 40 s call to end (refused against a 5 s wait limit); a committed call starts
    at once."""
    reps = Replicas.of([ObservedReplica("a", "ready", 4, 3, NOW - 600)])
    obs = observe_tier("t", NOW, 10.0, in_flight=3, replicas=reps)
    cap = tier_capacity(KEPT)

    def judge(p: Priority) -> bool:
        q = AdmissionInput(obs, cap, p, prompt_tokens=10, output_tokens=10, wait_limit_s=5.0, deadline_s=None)
        return judge_admission(q).admitted

    assert judge(Priority.committed)
    assert not judge(Priority.interactive)
    assert admission_forecast(obs, cap, Priority.interactive).free == 0
    assert admission_forecast(obs, cap, Priority.committed).free == 1


def test_a_saturated_window_of_lower_class_calls_reads_the_model_right() -> None:
    """Two replicas, saturated by interactive calls, serve at the rate 3 slots give: the model
    planned with 3, so the calibration keeps its factor (counting 4, it read them slow)."""
    cap = tier_capacity(KEPT)
    window = 1000.0
    three_slots = 3 / cap.service_s(cap.typical_prompt_tokens, cap.typical_output_tokens, 3)  # calls/s a replica
    served = round(2 * three_slots * window)
    reps = Replicas.of([ObservedReplica(f"r{i}", "ready", 4, 3, NOW - 5000) for i in range(2)])
    obs = observe_tier("t", NOW, window, line=(0, 20, 0, 0), oldest_wait_s=window + 100, in_flight=6,
                       completions_in_window=served, replicas=reps)
    prev = Calibration(startup_s=3.0, rate_factor=1.0, ready=2, ready_since=NOW - 2 * window)
    assert abs(calibrate(prev, KEPT, obs).rate_factor - 1.0) < 0.01
