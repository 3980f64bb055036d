"""The start-up model's error by term (`fleet.policy.cold_start`): a wrong profile shows as the
error of the term it got wrong; and the sim's phases add up to the model it budgets with."""

from __future__ import annotations

import pytest

from fleet.config import SimProfile, TierConfig
from fleet.policy.cold_start import ColdStartPhases, ModelledStartup, median_phases, model_error, modelled_startup
from fleet.replica_model import cold_start_s
from workers.engines.sim import cold_start_phases_s


def _phases(load: float, init: float, first: float, extra: float = 0.0) -> ColdStartPhases:
    return ColdStartPhases(load_s=load, init_s=init, first_token_s=first, total_s=load + init + first + extra)


def test_modelled_startup_splits_weights_and_warmup() -> None:
    tc = TierConfig(sim={"weights_gb": 16, "load_gb_s": 2, "warmup_s": 3})
    assert modelled_startup(tc) == ModelledStartup(total_s=11.0, load_s=8.0, warmup_s=3.0)
    # A tier that gives the start-up outright models the total only.
    assert modelled_startup(TierConfig(capacity={"startup_s": 5.0})) == ModelledStartup(total_s=5.0)


def test_a_slow_graph_capture_shows_as_the_warmup_terms_error() -> None:
    model = ModelledStartup(total_s=11.0, load_s=8.0, warmup_s=3.0)
    # Weights in as modelled, but init (graph capture) took 17 s, not the 3 s warm-up assumed.
    measured = [_phases(8.0, 17.0, 0.5), _phases(8.2, 16.0, 0.4), _phases(7.8, 18.0, 0.6)]
    errs = {e.term: e for e in model_error(measured, model)}
    assert errs["load"].error_s == pytest.approx(0.0)
    assert errs["warmup"].measured_s == pytest.approx(17.5)
    assert errs["warmup"].error_s == pytest.approx(14.5)
    assert errs["warmup"].ratio == pytest.approx(17.5 / 3.0)
    assert errs["total"].error_s == pytest.approx(25.5 - 11.0)


def test_model_error_with_a_total_only_model_and_unaccounted_time() -> None:
    model = ModelledStartup(total_s=5.0)
    p = _phases(1.0, 2.0, 0.5, extra=1.5)  # 1.5 s the engine did not attribute (spawn, imports)
    assert p.unaccounted_s == pytest.approx(1.5)
    errs = {e.term: e for e in model_error([p], model)}
    assert errs["total"].error_s == pytest.approx(0.0)
    assert errs["load"].modelled_s is None and errs["load"].error_s is None and errs["load"].ratio is None
    assert model_error([], model) == []


def test_median_phases_and_round_trip() -> None:
    ps = [_phases(1, 2, 3), _phases(2, 4, 6), _phases(9, 9, 9)]
    assert median_phases(ps) == {"load_s": 2, "init_s": 4, "first_token_s": 6, "total_s": 12, "unaccounted_s": 0}
    assert median_phases([]) is None
    p = ColdStartPhases(0.7, 17.0, 0.2, 18.5, compile_s=12.0)
    assert ColdStartPhases.from_dict(p.as_dict()) == p


@pytest.mark.parametrize(
    "profile", [SimProfile(), SimProfile(weights_gb=16, load_gb_s=2, warmup_s=3), SimProfile(warmup_s=0.0)]
)
def test_sim_phases_sum_to_the_modelled_cold_start(profile: SimProfile) -> None:
    load, init, first = cold_start_phases_s(profile)
    assert min(load, init, first) >= 0
    assert load + init + first == pytest.approx(cold_start_s(profile))
