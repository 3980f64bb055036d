"""The market-open shape of the load test (`loadtests.phases`): each phase in order, the open at the
peak, then done. The Locust run against a fleet: tests/processes/test_loadtest.py."""

from __future__ import annotations

from loadtests.phases import MARKET_SECONDS, PHASES, phase_at


def test_market_open_shape_phases() -> None:
    # The morning compressed to 90 s: each phase in order, the open at the peak, then done.
    scale = MARKET_SECONDS / 90
    seen = [phase_at(t, scale, 40) for t in range(0, 90)]
    names = [s[0] for s in seen if s]
    assert list(dict.fromkeys(names)) == [p[0] for p in PHASES]
    assert max(s[1] for s in seen if s) == 40 and dict(s for s in seen if s)["open"] == 40
    assert phase_at(90.5, scale, 40) is None
