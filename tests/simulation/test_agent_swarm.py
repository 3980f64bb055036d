"""The agent-swarm scenario: conversations whose turns re-send a growing context, replayed with
prefix-affine claims and without (`fleet simulate configs/scenarios/agent-swarm.yaml [--no-affinity]`)."""

from __future__ import annotations

from typing import Any

import yaml

from simulator.report import summarize
from simulator.run import simulate
from simulator.scenario import parse_scenario
from tests.paths import ROOT

SWARM = ROOT / "configs" / "scenarios" / "agent-swarm.yaml"


def _swarm(affinity: bool) -> dict[str, Any]:
    raw = yaml.safe_load(SWARM.read_text())
    raw["duration"] = "15m"
    raw["fleet"]["tiers"]["analysis"]["affinity"] = {"enabled": affinity}
    return summarize(simulate(parse_scenario(raw, SWARM), "fleet"), timeline=False)


def test_in_the_agent_swarm_the_prefix_caches_spare_prefill_with_affinity_or_without() -> None:
    on, off = _swarm(True), _swarm(False)
    assert on["goodput_rps"] == off["goodput_rps"]  # every call of both runs served: affinity loses none
    for s in (on, off):
        t = s["tiers"]["analysis"]
        assert 0.3 < t["prefix_cache_hit_rate"] < 0.9 and t["prefill_tokens"] < t["prompt_tokens"]
        assert s["tiers"]["routing"]["prefix_cache_hit_rate"] == 0.0  # no conversation there: nothing cached
