"""Degrade before shedding in the replay (`simulator.degrade`, docs/degrade.md): the simulator asks
the gateway's pure decision, and reports calls degraded beside those shed.

A large tier whose budget is $0 (spent from the first tick; priced per token too, so each call
it serves would spend: decision 0083) and a small one with room: the large tier's speculative
calls are served by the small one with its rule, shed without it; its
committed calls are served where they asked either way."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.config import CLASSES
from simulator.report import summarize
from simulator.run import simulate
from simulator.scenario import Scenario, parse_scenario

pytestmark = pytest.mark.timeout(600)

SIM = {"weights_gb": 1, "load_gb_s": 10, "warmup_s": 0, "prefill_tokens_per_s": 1.0e6,
       "decode_step": {"base_s": 0.01, "per_seq_s": 0.0}, "kv_capacity_tokens": 100000,
       "typical_prompt_tokens": 16, "typical_output_tokens": 20}


def _scenario(degrade: bool) -> Scenario:
    tier = {"warm_floor": 1, "max_replicas": 2, "slots": 8, "wait_limit_s": dict.fromkeys(CLASSES, 30.0),
            "hourly_usd": 1.0, "sim": SIM, "prewarm": []}
    big: dict[str, Any] = {**tier, "usd_per_million_tokens": 1.0, "budget": {"daily_usd": 0}}
    if degrade:
        big["degrade"] = {"to": "small", "classes": ["speculative"]}
    return parse_scenario({
        "start": "2026-11-30T12:00:00", "duration": 30, "seed": 5,
        "fleet": {"namespace": "sim", "rate_window_s": 10.0, "default_deadline_ms": 60000,
                  "tiers": {"small": dict(tier), "big": big}},
        "arrivals": [{"tier": "big", "class": cls, "process": "deterministic", "rate": 2.0,
                      "prompt_tokens": 16, "output_tokens": 20} for cls in ("committed", "speculative")],
    })


def test_speculative_calls_a_spent_tier_refuses_are_served_by_the_smaller_one() -> None:
    on = summarize(simulate(_scenario(True), "fleet", 5), timeline=False)
    off = summarize(simulate(_scenario(False), "fleet", 5), timeline=False)
    spec_off = off["tiers"]["big"]["classes"]["speculative"]
    assert spec_off["shed"].get("budget_exhausted", 0) >= 50 and "degraded" not in spec_off
    spec_on = on["tiers"]["big"]["classes"]["speculative"]
    # Refused by the big tier's budget, every one served by the small tier instead: counted at both.
    assert spec_on["shed"] == {} and spec_on["degraded"] == {"budget_exhausted": spec_off["shed"]["budget_exhausted"]}
    assert spec_on["degraded_to"] == {"small": spec_on["degraded"]["budget_exhausted"]}
    served = on["tiers"]["small"]["classes"]["speculative"]
    assert served["degraded_in"] == spec_on["degraded"]["budget_exhausted"] and served["arrived"] == 0
    assert served["completed"] >= served["degraded_in"] - 2  # a call or two may still run at the end
    # Committed is untouched: served by the tier it asked, with or without the rule.
    for s in (on, off):
        assert s["committed_on_time"] == s["committed_arrived"]
        assert "committed" not in s["tiers"]["small"]["classes"]
    assert on["goodput_rps"] > off["goodput_rps"]
