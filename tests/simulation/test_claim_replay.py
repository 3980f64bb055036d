"""The replay takes calls by the live claim's rule (`fleet.policy.choose_take`, decision 0080): the
slots a replica keeps for committed work (`reserved_slots`) hold in `fleet simulate` as live."""

from __future__ import annotations

from typing import Any

from simulator.run import simulate
from simulator.scenario import Scenario, parse_scenario
from simulator.state import Outcome


def _full_of_background(reserved: bool) -> Scenario:
    """Two replicas of four slots kept full by long background generations, committed calls
    arriving now and then; no preemption, so only a reserved slot lets committed in at once."""
    tier: dict[str, Any] = {
        "warm_floor": 2,
        "max_replicas": 2,
        "slots": 4,
        "hourly_usd": 1.0,
        "drain_threshold_s": 1000.0,
        "wait_limit_s": {c: 3000.0 for c in ("committed", "interactive", "speculative", "background")},
        "preemption": {"enabled": False},
        "sim": {
            "weights_gb": 1,
            "load_gb_s": 10,
            "warmup_s": 0,
            "kv_capacity_tokens": 200000,
            "decode_step": {"base_s": 0.02, "per_seq_s": 0.001},
        },
    }
    raw = {
        "start": "2026-11-30T09:00:00",
        "duration": "4m",
        "seed": 3,
        "fleet_config": "configs/fleet.yaml",
        "fleet": {"tiers": {"planner": tier}},
        "arrivals": [
            {
                "tier": "planner",
                "class": "background",
                "rate": 1.0,
                "prompt_tokens": 200,
                "output_tokens": 512,
                "deadline_ms": 3_000_000,
            },
            {
                "tier": "planner",
                "class": "committed",
                "rate": 0.2,
                "prompt_tokens": 200,
                "output_tokens": 20,
                "deadline_ms": 300_000,
            },
        ],
    }
    sc = parse_scenario(raw)
    if not reserved:
        sc.cfg.tiers["planner"].preemption.reserved_slots = {}
    return sc


def _p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def test_a_reserved_slot_lets_committed_in_without_preempting() -> None:
    sc = _full_of_background(True)
    assert sc.cfg.tiers["planner"].preemption.reserved_slots == {"committed": 1}  # the shipped config's
    runs: dict[bool, list[Outcome]] = {
        r: simulate(_full_of_background(r), "fleet").tiers["planner"].outcomes for r in (True, False)
    }
    kept, none = runs[True], runs[False]
    assert _p50(kept[0].waits) < 0.5 < _p50(none[0].waits)  # committed no longer waits for a 512-token run
    assert kept[0].preempted == kept[3].preempted == 0
    assert kept[0].completed == none[0].completed > 0
    # The slot kept idle for committed costs background some wait, never a call.
    assert kept[3].completed == none[3].completed and _p50(kept[3].waits) >= _p50(none[3].waits)


def test_the_same_seed_replays_the_same_takes() -> None:
    a, b = (simulate(_full_of_background(True), "fleet").tiers["planner"].outcomes for _ in range(2))
    assert [o.waits for o in a] == [o.waits for o in b]
