"""The scaler and the simulator are adapters around one tick, `fleet.policy.plan_tier`
(and the gateway and the simulator around one admission, `judge_admission`): each fills the
input from what it observes and carries out the plan. These tests check the adapters:

- the live scaler fills the input from Redis and its supervisor (the line, the heartbeats,
  the budget judgement, the operator's pre-warm orders, the GPU room) and executes the plan;
- the simulator fills it from the replay (its own orders and GPU room: none, said so) and
  carries the plan's calibrated capacity into its admission;
- given the same world, both fill the same input and so reach the same decision, reason
  for reason.

Live: a real `Scaler` ticks one tier on real Redis; its supervisor's backend only records
launches, so no process starts. Simulated: the same calls arrive in a `Simulator` with the
same replicas and the same budget judgement, and its policy ticks.
"""

from __future__ import annotations

import time
import uuid

import orjson
import pytest
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.policy import (
    AdmissionInput,
    PlanInput,
    PlanState,
    ScaleDecision,
    judge_admission,
    plan_tier,
)
from fleet.policy.tier_budget import BudgetView
from fleet.store.keys import TierKeys
from fleet.store.ledger import Spend
from fleet.store.line import Line
from fleet.store.prewarm_orders import add_order
from fleet.store.tier_budget import BudgetState, publish_budget_state
from scaler.backends import Supervised
from scaler.loop import Scaler
from scaler.placement import Gpu, Placement
from scaler.supervisor import Supervisor
from simulator.arrivals import Call, Trace
from simulator.engine import Simulator
from simulator.policies import NO_ORDERS, Action, OurPolicy
from simulator.scenario import Scenario, parse_scenario
from tests.backends import NoLaunch
from tests.harness import call_payload

TIER = "routing"


class RecordingBackend(NoLaunch):
    """Starts nothing; remembers what the supervisor asked for."""

    name = "recording"

    def __init__(self) -> None:
        self.launched: list[str] = []

    def launch(self, rec: Supervised) -> None:
        self.launched.append(rec.id)


def _scenario(namespace: str, gpus: list[dict[str, float]] | None = None, **overrides: object) -> Scenario:
    tier: dict[str, object] = {
        "warm_floor": 1, "max_replicas": 8, "drain_threshold_s": 2.0, "slots": 1, "scale_in_hold_s": 30,
        "hourly_usd": 3.0, "wait_limit_s": {"committed": 600.0},
        "sim": {"weights_gb": 4, "load_gb_s": 2, "warmup_s": 1, "prefill_tokens_per_s": 10000,
                "decode_step": {"base_s": 0.05, "per_seq_s": 0.0}, "kv_capacity_tokens": 65536,
                "typical_prompt_tokens": 10, "typical_output_tokens": 10}}
    tier.update(overrides)
    return parse_scenario({"start": "2026-11-30T12:00:00", "duration": 60,
                           "fleet": {"namespace": namespace, "rate_window_s": 10.0, "heartbeat_s": 1.0,
                                     "gpus": gpus or [], "tiers": {TIER: tier}}})


def _view(ceiling: int) -> BudgetView:
    return BudgetView(exhausted=False, window="daily", retry_at=None, spent_usd=10.0, projected_usd=90.0,
                      budget_usd=100.0, ceiling=ceiling, capped=True, burn_usd_per_s=0.002,
                      reason=f"the daily budget allows {ceiling} replicas")


async def _world(r: Redis, sc: Scenario, ready: int, waiting: int, ceiling: int | None) -> None:
    """On Redis: `ready` replicas each running one call (one slot each), `waiting` calls in the
    line, and the budget governor's judgement allowing `ceiling` replicas (None: none published)."""
    cfg = sc.cfg
    k = TierKeys(cfg.namespace, TIER)
    line = Line(r, cfg.namespace, TIER, result_ttl_s=60, rate_window_s=cfg.rate_window_s)
    payload = call_payload("x", 10)
    for _ in range(ready + waiting):
        await line.enqueue(uuid.uuid4().hex, Priority.committed, payload, 60_000)
    assert len(await line.claim("w", ready, 30.0)) == ready
    now = time.time()
    for i in range(ready):
        beat = {"state": "ready", "slots": 1, "in_use": 1, "completed": 0, "cold_start_s": None, "ts": now,
                "started": now - 100, "pid": 0}
        await r.hset(k.replicas, f"{TIER}-r{i}", orjson.dumps(beat))
    if ceiling is not None:
        await publish_budget_state(r, k, BudgetState(_view(ceiling), Spend(), now - 3600, now + 3600, 0.0,
                                                     float("inf"), now), 30)


async def _live(redis_url: str, sc: Scenario, ready: int, waiting: int,
                ceiling: int | None) -> tuple[ScaleDecision, list[str]]:
    r = Redis.from_url(redis_url)
    try:
        await _world(r, sc, ready, waiting, ceiling)
        backend = RecordingBackend()
        scaler = Scaler(sc.cfg, r, Supervisor(sc.cfg, r, backend, Placement([])))
        decision = await scaler.tick_tier(TIER)
        return decision, backend.launched
    finally:
        await r.aclose()


def _simulated(sc: Scenario, ready: int, waiting: int, ceiling: int | None) -> Action:
    sim = Simulator(sc, Trace([], []), OurPolicy())
    tier = sim.tiers[TIER]
    for _ in range(ready):
        sim.start_replica(tier, ready=True)
    for _ in range(ready + waiting):
        sim.arrive(Call(TIER, 0, 10, 10), 60.0)
    assert tier.in_flight == ready and tier.waiting == waiting
    sim.t = 0.2
    tier.budget_view = _view(ceiling) if ceiling is not None else None
    return sim.policy.scale(sim.observe(tier), tier.tc)


async def test_the_scaler_fills_the_input_from_redis_and_its_supervisor_and_executes_the_plan(
        redis_url: str) -> None:
    """Everything the live tick reads goes into the plan's input (an operator's pre-warm order
    and the GPU room included), and what the scaler starts is what the plan says."""
    sc = _scenario(f"adapt-{uuid.uuid4().hex[:8]}", gpus_per_replica=1, gpu_memory_gb=40)
    r = Redis.from_url(redis_url)
    try:
        await _world(r, sc, ready=2, waiting=12, ceiling=3)
        k = TierKeys(sc.cfg.namespace, TIER)
        await add_order(r, k, floor=4, until=time.time() + 600, now=time.time())
        backend = RecordingBackend()
        # One 80 GB GPU, nothing booked on it by this supervisor: room for two 40 GB replicas.
        scaler = Scaler(sc.cfg, r, Supervisor(sc.cfg, r, backend, Placement([Gpu(0, 80.0)])))
        inp, _ = await scaler._plan_input(TIER, k)
        assert inp.cfg is sc.cfg.tiers[TIER] and inp.tick_s == scaler.tick_s
        assert inp.obs.line[Priority.committed] == 12 and inp.obs.replicas.ready == 2
        assert inp.obs.budget is not None and inp.obs.budget.ceiling == 3
        assert [o.floor for o in inp.orders] == [4]
        assert inp.gpu_room == 2
        planned = plan_tier(inp, scaler.plans[TIER])
        assert planned.prewarm.floor == 4 and planned.decision.ceiling == 3  # the order, and the budget binds
        decision = await scaler.tick_tier(TIER)
    finally:
        await r.aclose()
    expected = planned.decision
    assert (decision.action, decision.delta, decision.code, decision.floor, decision.ceiling,
            decision.ceiling_by) == (expected.action, expected.delta, expected.code, expected.floor,
                                     expected.ceiling, expected.ceiling_by) == (
        "scale_out", 1, "drain", 4, 3, "budget")
    assert len(backend.launched) == 1  # it executed the plan
    state = scaler.plans[TIER]
    assert state.calibration is not None and state.calm_since == decision.calm_since  # carried to the next tick


def test_the_simulator_fills_the_input_from_the_replay_and_admits_on_the_plan_s_capacity() -> None:
    """The replay's input says what it has: no operator orders, and its own GPU room (its
    replicas booked on the scenario's `gpus:`); its tick is the scenario's, and the capacity
    the plan calibrated is the one its admission judges on."""
    # One 120 GB GPU, two 40 GB replicas on it: room for one more.
    sc = _scenario(f"adapt-{uuid.uuid4().hex[:8]}", gpus=[{"index": 0, "memory_gb": 120.0}],
                   gpus_per_replica=1, gpu_memory_gb=40)
    sim = Simulator(sc, Trace([], []), OurPolicy())
    sim.policy.prepare(sc)
    tier = sim.tiers[TIER]
    for _ in range(2):
        sim.start_replica(tier, ready=True)
    for _ in range(14):
        sim.arrive(Call(TIER, 0, 10, 10), 60.0)
    sim.t = 0.2
    assert sim.serving.gpus.room(tier.tc) == 1
    obs = sim.observe(tier)
    expected = plan_tier(PlanInput(obs, tier.tc, sc.spec.tick_s, NO_ORDERS, 1), PlanState())
    d = expected.decision
    assert (d.action, d.delta, d.ceiling, d.ceiling_by) == ("scale_out", 1, 3, "gpu_memory")
    sim.tick()  # the replay's scaler tick: observe, plan with its own room, start what the plan says
    entry = sim.decisions[-1]
    assert (entry.action, entry.delta, entry.reason, entry.ceiling) == (d.action, d.delta, d.reason, d.ceiling)
    assert tier.n_starting == 1 and sim.serving.gpus.room(tier.tc) == 0  # booked
    assert sim.policy.plans[TIER] == expected.state  # calm and calibration carried
    cap = sim.policy.capacity[TIER]
    assert cap == expected.capacity
    judged = judge_admission(AdmissionInput.for_tier(obs, cap, tier.tc, Priority.background, prompt_tokens=10,
                                                     output_tokens=cap.output_estimate(None), deadline_s=60.0))
    assert sim.policy.admit(obs, tier.tc, Priority.background, 10, 60.0) == judged.reason


@pytest.mark.parametrize(("ready", "waiting", "ceiling", "action"), [
    (2, 12, None, "scale_out"),   # a line with nothing served: drain is infinite, order for the backlog
    (2, 12, 3, "scale_out"),      # the same, but the budget allows one more only
    (3, 12, 3, "capped"),         # at the budget's ceiling: add nothing, say why
    (3, 0, None, "hold"),         # empty line, more than needed, but not calm for long enough yet
])
async def test_given_the_same_world_both_adapters_reach_the_same_decision(redis_url: str, ready: int,
                                                                         waiting: int, ceiling: int | None,
                                                                         action: str) -> None:
    sc = _scenario(f"simshared-{uuid.uuid4().hex[:8]}")
    live, launched = await _live(redis_url, sc, ready, waiting, ceiling)
    sim = _simulated(sc, ready, waiting, ceiling)
    assert live.action == action
    assert (sim.action, sim.delta, sim.reason_kind, sim.floor, sim.ceiling) == (
        live.action, live.delta, live.code, live.floor, live.ceiling)
    assert sim.reason == live.reason
    assert len(launched) == max(0, live.delta)  # the live scaler executed what it decided
