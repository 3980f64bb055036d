"""The replay takes what the engine holds: a replica claims no more calls at once than its KV cache
holds at the tier's typical shape (`fleet.policy.tier_capacity.claim_concurrency`), as the live
worker claims (`workers.worker.Worker._concurrency`), whatever its slots (decision 0084)."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.policy.tier_capacity import claim_concurrency
from simulator.run import simulate
from simulator.scenario import Scenario, parse_scenario
from simulator.serving import Serving
from simulator.state import Req, SimReplica, TierSim


def _long_context_tier(slots: int = 12, kv_tokens: int = 8_000) -> Scenario:
    """One tier of 12 slots whose KV cache holds 8 calls of its typical shape (900 + 100 tokens),
    sent short calls (250 tokens) fast enough to fill every slot: their KV room alone would let a
    replica run 12 of them."""
    tier: dict[str, Any] = {
        "warm_floor": 2, "max_replicas": 2, "slots": slots, "hourly_usd": 1.0,
        "preemption": {"enabled": False},
        "sim": {"weights_gb": 1, "load_gb_s": 10, "warmup_s": 0, "kv_capacity_tokens": kv_tokens,
                "typical_prompt_tokens": 900, "typical_output_tokens": 100,
                "decode_step": {"base_s": 0.02, "per_seq_s": 0.001}},
    }
    raw = {
        "start": "2026-11-30T09:00:00", "duration": "2m", "seed": 5, "fleet_config": "configs/fleet.yaml",
        "fleet": {"tiers": {"planner": tier}},
        "arrivals": [{"tier": "planner", "class": "background", "rate": 20.0, "prompt_tokens": 200,
                      "output_tokens": 50, "deadline_ms": 600_000}],
    }
    sc = parse_scenario(raw)
    sc.cfg.tiers["planner"].preemption.reserved_slots = {}  # every slot background's (none kept)
    return sc


def test_the_claim_concurrency_is_the_slots_bounded_by_the_kv_cache_at_the_typical_shape() -> None:
    tc = _long_context_tier().cfg.tiers["planner"]
    assert claim_concurrency(tc, 8_000) == 8  # 8,000 tokens / 1,000 a typical call
    assert claim_concurrency(tc, 1_000_000) == tc.slots == 12  # room for more: the slots bound it
    assert claim_concurrency(tc, None) == 12  # an engine that does not say: the slots
    assert claim_concurrency(tc, 10) == 1  # always at least one


def test_a_replica_never_runs_more_calls_than_its_kv_cache_holds_at_the_typical_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    most: dict[str, int] = {}
    begin = Serving.begin

    def counted(self: Serving, tier: TierSim, req: Req, r: SimReplica) -> None:
        begin(self, tier, req, r)
        most[r.id] = max(most.get(r.id, 0), r.running)

    monkeypatch.setattr(Serving, "begin", counted)
    res = simulate(_long_context_tier(), "fleet")
    planner = [n for k, n in most.items() if k.startswith("planner")]
    assert planner and max(planner) == 8  # full, at what the engine holds: not its 12 slots
    assert res.tiers["planner"].outcomes[3].completed > 1000


def test_the_hpa_baseline_reads_utilisation_over_the_slots_the_replicas_report() -> None:
    """HPA's busy-slot target counts the slots a replica reports (its KV-bounded concurrency), as
    a pod metric would: 16 calls on two replicas that each hold 8 is 100% busy, a scale-out, not
    the 67% that a 12-slot count reads, which sits inside its tolerance and never scales."""
    from fleet.config import TierConfig
    from fleet.policy.observation import observe_tier
    from fleet.policy.replicas import ObservedReplica
    from simulator.baselines import Hpa

    tc = TierConfig(slots=12)
    members = [ObservedReplica(f"r{i}", "ready", 8, 8, 0.0) for i in range(2)]
    obs = observe_tier("analysis", 100.0, 10.0, in_flight=16, replicas=members)
    want, why = Hpa().recommend(obs, tc, 2)
    assert want == 3 and "100%" in why, (want, why)
