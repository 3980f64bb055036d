"""Replays of the shipped scenarios that more than one test reads, made once a session.

A replay of a shipped scenario takes 10-35 s here, and several tests asked for the same one
(market-open and retry-storm under the fleet's policy, azure-long-context under every policy):
`make test` ran each again. The replays are deterministic (a scenario's own seed and trace), and
the tests only read them. Only the shared ones are kept: a session holding every replay of every
policy would hold gigabytes.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from simulator.arrivals import Trace, build_trace
from simulator.results import SimResult
from simulator.run import simulate
from simulator.scenario import Scenario, load_scenario


@cache
def scenario(path: Path) -> tuple[Scenario, Trace]:
    """The scenario at `path` and its trace, drawn with its own seed."""
    sc = load_scenario(path)
    return sc, build_trace(sc, sc.spec.seed)


@cache
def replay(path: Path, policy: str) -> SimResult:
    """The scenario at `path` replayed under `policy`, with its own seed and trace."""
    sc, trace = scenario(path)
    return simulate(sc, policy, sc.spec.seed, trace)
