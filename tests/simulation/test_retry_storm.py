"""Callers that behave like the SDK in the replay (`simulator.clients`): a timeout, retries with the
SDK's backoff, and what the fleet does with them, on and off (`fleet` against `fleet-noclock`).

One call whose answer takes 5 s behind a client timeout of 2 s, on a replica with room for it:
- off, every attempt is a new call, the SDK's backoff apart, and each runs on for nobody;
- on, the call is parked when its caller leaves and each retry takes it over: one run of the
  engine answers the caller, nothing for nobody.
Then the retry-storm scenario (configs/scenarios/retry-storm.yaml, replayed under both): the goals
of issue 37 met there, asserted (docs/results.md, "The simulator's retry storm", says which are not).
Attempts per answered call cannot reach the issue's 1.2 at 3x overload: every call the fleet cannot
serve asks once, so calls over answered (about 2.66 here) is its floor; what is asserted is that
retries add little above it (refusals under a sustained overload say `x-should-retry: false`,
docs/decisions/0081-no-retry-under-sustained-overload.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from fleet.config import CLASSES
from simulator.results import SimResult
from simulator.run import simulate
from simulator.scenario import Scenario, ScenarioError, load_scenario, parse_scenario
from tests.paths import ROOT
from tests.simulation.replays import replay

RETRY_STORM = ROOT / "configs" / "scenarios" / "retry-storm.yaml"
# The storm's two replays take about a minute each on a quiet box (more on a busy one).
pytestmark = pytest.mark.timeout(900)
STEP_S = 0.01  # a decode step: 500 tokens in 5 s, whatever the batch
TIMEOUT_S = 2.0


def _one_call(client: dict[str, Any] | None = None, *, slots: int = 4) -> Scenario:
    """One call at t=1 s whose answer takes about 5 s, from a caller with an SDK client."""
    return parse_scenario({
        "start": "2026-11-30T12:00:00", "duration": 1.5, "seed": 3,
        "client": client or {"timeout_s": TIMEOUT_S},
        "fleet": {"namespace": "sim", "rate_window_s": 10.0, "default_deadline_ms": 60000, "tiers": {"solo": {
            "warm_floor": 1, "max_replicas": 1, "slots": slots, "wait_limit_s": dict.fromkeys(CLASSES, 30.0),
            "sim": {"weights_gb": 1, "load_gb_s": 1, "warmup_s": 0, "prefill_tokens_per_s": 1.0e6,
                    "decode_step": {"base_s": STEP_S, "per_seq_s": 0.0}, "kv_capacity_tokens": 100000,
                    "typical_prompt_tokens": 16, "typical_output_tokens": 500}}}},
        "arrivals": [{"tier": "solo", "class": "interactive", "process": "deterministic", "rate": 1.0,
                      "prompt_tokens": 16, "output_tokens": 500}],
    })


def _enqueued(r: SimResult) -> list[float]:
    """When the tier's line took each new call (an attempt that joined one takes none)."""
    return list(r.tiers["solo"].enq_times)


def test_a_client_that_times_out_retries_after_the_sdks_backoff() -> None:
    r = simulate(_one_call(), "fleet-noclock")
    c = r.callers
    assert c is not None
    assert (c["calls"], c["attempts"], c["abandoned"], c["answered"]) == (1, 3, 3, 0)
    assert c["failed"] == {"timed_out": 1}
    assert c["agent_s_abandoned"] == pytest.approx(3 * TIMEOUT_S)
    first, second, third = _enqueued(r)
    assert first == pytest.approx(1.0)
    # The openai client's: 0.5 s x 2^n, shortened by up to a quarter (jitter), after each timeout.
    assert 0.375 - 1e-9 <= second - first - TIMEOUT_S <= 0.5 + 1e-9
    assert 0.75 - 1e-9 <= third - second - TIMEOUT_S <= 1.0 + 1e-9


def test_the_backoff_is_capped_as_the_scenario_says() -> None:
    r = simulate(_one_call({"timeout_s": TIMEOUT_S, "retries": 2, "backoff": {"initial_s": 4, "max_s": 6,
                                                                                  "jitter": 0}}), "fleet-noclock")
    first, second, third = _enqueued(r)
    assert second - first - TIMEOUT_S == pytest.approx(4.0)
    assert third - second - TIMEOUT_S == pytest.approx(6.0)  # 8 s, capped at 6


def test_a_joined_retry_costs_no_engine_work() -> None:
    r = simulate(_one_call(), "fleet")
    c = r.callers
    assert c is not None
    # Two timeouts, two retries that took the call over; the answer came while it was parked
    # after the second, and the last retry read it.
    assert (c["attempts"], c["joined"], c["abandoned"], c["answered"]) == (3, 2, 2, 1)
    assert len(_enqueued(r)) == 1  # one call in the line: the retries ran nothing again
    assert c["engine_s"] == pytest.approx(5.0, abs=0.1)  # the one run of the engine
    assert c["engine_s_nobody"] == 0.0
    o = r.tiers["solo"].outcomes[1]
    assert (o.arrived, o.completed, o.cancelled, o.unheard) == (1, 1, 0, 0)


def test_features_off_spend_engine_seconds_for_nobody() -> None:
    on, off = simulate(_one_call(), "fleet"), simulate(_one_call(), "fleet-noclock")
    assert off.callers is not None and on.callers is not None
    assert off.callers["answered"] == 0 and on.callers["answered"] == 1
    # Off, each of the three attempts ran its 5 s to the end, for a caller already gone.
    assert off.callers["engine_s_nobody"] == pytest.approx(15.0, abs=0.3)
    assert off.callers["engine_nobody_share"] == 1.0
    o = off.tiers["solo"].outcomes[1]
    assert (o.completed, o.unheard) == (0, 3)  # completed in the engine, received by nobody: no goodput
    # A baseline's gateway is one with the features off.
    static = simulate(_one_call(), "static")
    assert static.callers is not None and static.callers["engine_s_nobody"] == pytest.approx(15.0, abs=0.3)


def test_a_parked_call_nobody_takes_is_cancelled_after_the_grace() -> None:
    # The SDK makes no retry, yet the gateway (expecting the default 2) parks the call: the engine
    # works at most the grace for a caller that never returns.
    r = simulate(_one_call({"timeout_s": TIMEOUT_S, "retries": 0}), "fleet")
    c = r.callers
    assert c is not None
    assert (c["attempts"], c["answered"], c["failed"]) == (1, 0, {"timed_out": 1})
    o = r.tiers["solo"].outcomes[1]
    assert (o.completed, o.unheard) == (0, 1)  # done within the 10 s grace, its answer kept for nobody
    assert c["engine_s_nobody"] == pytest.approx(5.0, abs=0.1)


def test_a_bad_client_names_its_field() -> None:
    raw = {"start": "2026-11-30T12:00:00", "duration": 10, "fleet": {"tiers": {"solo": {}}},
           "arrivals": [{"tier": "solo", "class": "interactive", "rate": 1.0}]}
    with pytest.raises(ScenarioError, match=r"client\.timeout_s: Input should be greater than 0"):
        parse_scenario({**raw, "client": {"timeout_s": 0}})
    bad_stream = [{**raw["arrivals"][0], "client": {"timeout_s": 30, "retries": -1}}]
    with pytest.raises(ScenarioError, match=r"arrivals\.0\.client\.retries"):
        parse_scenario({**raw, "arrivals": bad_stream})
    with pytest.raises(ScenarioError, match=r"client\.backoff\.jiter: Extra inputs"):
        parse_scenario({**raw, "client": {"timeout_s": 30, "backoff": {"jiter": 0.1}}})


# --- the retry-storm scenario ------------------------------------------------------------------


@pytest.fixture(scope="module")
def storm() -> dict[str, SimResult]:
    return {p: replay(RETRY_STORM, p) for p in ("fleet", "fleet-noclock")}


def test_the_storm_is_about_three_times_what_the_ceilings_serve() -> None:
    from fleet.policy import tier_capacity
    from simulator.baselines import peak_arrival_rate

    sc = load_scenario(RETRY_STORM)
    assert sc.spec.client is not None and sc.spec.client.timeout_s == 30
    for tier, tc in sc.cfg.tiers.items():
        served = tier_capacity(tc).per_replica_rate * tc.max_replicas
        assert 2.3 <= peak_arrival_rate(sc, tier) / served <= 4.5, tier


def test_the_storm_spends_at_most_two_percent_of_engine_seconds_on_calls_nobody_received(
        storm: dict[str, SimResult]) -> None:
    on, off = storm["fleet"].callers, storm["fleet-noclock"].callers
    assert on is not None and off is not None
    assert on["engine_nobody_share"] <= 0.02  # 0.1% (seed 7); off 15.5%
    assert off["engine_nobody_share"] > 5 * on["engine_nobody_share"]  # the features off: a storm of work for nobody


def test_the_storm_completes_twice_the_chains_of_the_fleet_with_its_features_off(
        storm: dict[str, SimResult]) -> None:
    on, off = storm["fleet"].callers, storm["fleet-noclock"].callers
    assert on is not None and off is not None
    assert on["chains_completed"] >= 2 * off["chains_completed"]  # 4015 against 487 (seed 7): 8.2x
    assert on["engine_s_failed_chains"] < off["engine_s_failed_chains"]
    assert on["agent_s_abandoned"] < off["agent_s_abandoned"]


def test_the_storm_retries_little_above_one_attempt_a_call(storm: dict[str, SimResult]) -> None:
    on, off = storm["fleet"].callers, storm["fleet-noclock"].callers
    assert on is not None and off is not None
    floor = on["calls"] / on["answered"]  # each call asks once: at 3x overload, about 2.66 (seed 7)
    assert on["attempts_per_answered_call"] <= 1.05 * floor  # 2.75 (seed 7): retries add 3.5%
    assert on["attempts_per_answered_call"] <= 0.5 * off["attempts_per_answered_call"]  # off: 5.70
    assert on["attempts_an_answer_took"] <= 1.1  # 1.03; off 1.64


def test_the_storm_costs_no_more_replica_hours_than_the_fleet_with_its_features_off(
        storm: dict[str, SimResult]) -> None:
    hours = {p: sum(t.replica_seconds for t in r.tiers.values()) / 3600 for p, r in storm.items()}
    assert hours["fleet"] <= hours["fleet-noclock"]  # 9.27 against 9.28 (seed 7)
