"""Run a scenario under a policy: the entry point the CLI and the tests use."""

from __future__ import annotations

from collections.abc import Callable

from simulator.arrivals import Trace, build_trace
from simulator.baselines import BASELINES
from simulator.engine import Simulator
from simulator.policies import NoClockPolicy, OurPolicy, SimPolicy
from simulator.results import SimResult
from simulator.scenario import Scenario

POLICIES: dict[str, type[SimPolicy]] = {"fleet": OurPolicy, **BASELINES}
# Our policy with a feature off: replayed by name, and by `--compare` where it matters (a scenario
# whose callers have an SDK client: `fleet-noclock`, the caller's clock off).
VARIANTS: dict[str, type[SimPolicy]] = {"fleet-noclock": NoClockPolicy}


class UnknownPolicy(ValueError):
    pass


def make_policy(name: str) -> SimPolicy:
    try:
        return {**POLICIES, **VARIANTS}[name]()
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; policies are {', '.join([*POLICIES, *VARIANTS])}") from None


def simulate(sc: Scenario, policy: str | SimPolicy = "fleet", seed: int | None = None,
             trace: Trace | None = None, fairness: str | None = None,
             progress: Callable[[float], None] | None = None) -> SimResult:
    """Replay the scenario's trace (drawn for `seed`, default the scenario's) under one policy.
    `fairness` ("fair" or "fifo"): every tier's order within a class, whatever its config says.
    `progress`: told the simulated time (seconds into the replay) now and then."""
    p = make_policy(policy) if isinstance(policy, str) else policy
    seed = sc.spec.seed if seed is None else seed
    tr = trace if trace is not None else build_trace(sc, seed)
    result = Simulator(sc, tr, p, fairness, progress, seed).run()
    result.seed = seed
    return result
