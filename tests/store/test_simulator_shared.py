"""The simulator and the live scaler decide alike: the same observed state, fed to both paths,
gives the same decision, because both call `fleet.policy.decide_tier` on the state they built.

Live: a real `Scaler` ticks one tier on real Redis (a line with calls enqueued and claimed,
replica heartbeats, the budget governor's published judgement); its supervisor's backend
only records launches, so no process starts. Simulated: the same calls arrive in a
`Simulator` with the same replicas and the same budget judgement, and its policy ticks.
"""

from __future__ import annotations

import time
import uuid

import orjson
import pytest
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.policy import ScaleDecision
from fleet.policy.tier_budget import BudgetView
from fleet.store.keys import TierKeys
from fleet.store.ledger import Spend
from fleet.store.line import Line
from fleet.store.tier_budget import BudgetState, publish_budget_state
from scaler.backends import Supervised
from scaler.loop import Scaler
from scaler.placement import Placement
from scaler.supervisor import Supervisor
from simulator.arrivals import Call, Trace
from simulator.engine import Simulator
from simulator.policies import Action, OurPolicy
from simulator.scenario import Scenario, parse_scenario
from tests.harness import call_payload

TIER = "routing"


class RecordingBackend:
    """Starts nothing; remembers what the supervisor asked for."""

    name = "recording"

    def __init__(self) -> None:
        self.launched: list[str] = []

    def launch(self, rec: Supervised) -> None:
        self.launched.append(rec.id)

    def alive(self, rec: Supervised) -> bool:
        return True

    def terminate(self, rec: Supervised) -> None: ...

    def kill(self, rec: Supervised) -> None: ...

    def cleanup(self, rec: Supervised) -> None: ...

    def adopt(self, rec: Supervised) -> bool:
        return False

    def discover(self, namespace: str) -> list[Supervised]:
        return []


def _scenario(namespace: str) -> Scenario:
    tier = {"warm_floor": 1, "max_replicas": 8, "drain_threshold_s": 2.0, "slots": 1, "scale_in_hold_s": 30,
            "hourly_usd": 3.0, "wait_limit_s": {"committed": 600.0},
            "sim": {"weights_gb": 4, "load_gb_s": 2, "warmup_s": 1, "prefill_tokens_per_s": 10000,
                    "decode_step": {"base_s": 0.05, "per_seq_s": 0.0}, "kv_capacity_tokens": 65536,
                    "typical_prompt_tokens": 10, "typical_output_tokens": 10}}
    return parse_scenario({"start": "2026-11-30T12:00:00", "duration": 60,
                           "fleet": {"namespace": namespace, "rate_window_s": 10.0, "heartbeat_s": 1.0,
                                     "tiers": {TIER: tier}}})


def _view(ceiling: int) -> BudgetView:
    return BudgetView(exhausted=False, window="daily", retry_at=None, spent_usd=10.0, projected_usd=90.0,
                      budget_usd=100.0, ceiling=ceiling, capped=True, burn_usd_per_s=0.002,
                      reason=f"the daily budget allows {ceiling} replicas")


async def _live(redis_url: str, sc: Scenario, ready: int, waiting: int,
                ceiling: int | None) -> tuple[ScaleDecision, list[str]]:
    cfg = sc.cfg
    r = Redis.from_url(redis_url)
    k = TierKeys(cfg.namespace, TIER)
    try:
        line = Line(r, cfg.namespace, TIER, result_ttl_s=60, rate_window_s=cfg.rate_window_s)
        payload = call_payload("x", 10)
        for _ in range(ready + waiting):
            await line.enqueue(uuid.uuid4().hex, Priority.committed, payload, 60_000)
        # One call in flight on each ready replica (one slot each), the rest in the line.
        assert len(await line.claim("w", ready, 30.0)) == ready
        now = time.time()
        for i in range(ready):
            beat = {"state": "ready", "slots": 1, "in_use": 1, "completed": 0, "cold_start_s": None, "ts": now,
                    "started": now - 100, "pid": 0}
            await r.hset(k.replicas, f"{TIER}-r{i}", orjson.dumps(beat))
        if ceiling is not None:
            await publish_budget_state(r, k, BudgetState(_view(ceiling), Spend(), now - 3600, now + 3600, 0.0,
                                                         float("inf"), now), 30)
        backend = RecordingBackend()
        scaler = Scaler(cfg, r, Supervisor(cfg, r, backend, Placement([])))
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


@pytest.mark.parametrize(("ready", "waiting", "ceiling", "action"), [
    (2, 12, None, "scale_out"),   # a line with nothing served: drain is infinite, order for the backlog
    (2, 12, 3, "scale_out"),      # the same, but the budget allows one more only
    (3, 12, 3, "capped"),         # at the budget's ceiling: add nothing, say why
    (3, 0, None, "hold"),         # empty line, more than needed, but not calm for long enough yet
])
async def test_simulator_and_live_scaler_reach_the_same_decision(redis_url: str, ready: int, waiting: int,
                                                                 ceiling: int | None, action: str) -> None:
    sc = _scenario(f"simshared-{uuid.uuid4().hex[:8]}")
    live, launched = await _live(redis_url, sc, ready, waiting, ceiling)
    sim = _simulated(sc, ready, waiting, ceiling)
    assert live.action == action
    assert (sim.action, sim.delta, sim.reason_kind, sim.floor, sim.ceiling) == (
        live.action, live.delta, live.code, live.floor, live.ceiling)
    assert sim.reason == live.reason
    assert len(launched) == max(0, live.delta)  # the live scaler executed what it decided
