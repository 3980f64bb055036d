"""`--compare`'s work, as jobs for `simulator.parallel`: every other policy's replay, summarised
with its served bound, the fairness runs, and the clairvoyant bounds.

`fleet simulate --compare` and `scripts/scenario_table.py` both start them beside the
main replay and assemble the same rows they assembled when everything ran in turn.
"""

from __future__ import annotations

from typing import Any

from simulator.arrivals import Trace
from simulator.bound import TierBound, clairvoyant_bound, hours, served_bound
from simulator.fairness import fairness_run, fairness_runs, is_main_run, reused_row
from simulator.parallel import Job
from simulator.report import summarize
from simulator.results import SimResult
from simulator.run import POLICIES, VARIANTS, simulate
from simulator.scenario import Scenario


def policy_summary(sc: Scenario, trace: Trace, policy: str, seed: int) -> tuple[dict[str, Any], float]:
    """One policy's replay: its summary (no timeline) and its served bound in replica-hours."""
    r = simulate(sc, policy, seed, trace)
    return summarize(r, timeline=False), hours(served_bound(sc, trace, r))


def bound(sc: Scenario, trace: Trace, max_class: int, keep_floor: bool) -> dict[str, TierBound]:
    """A clairvoyant bound (`simulator.bound.clairvoyant_bound`)."""
    return clairvoyant_bound(sc, trace, max_class=max_class, keep_floor=keep_floor)


# The baselines' replays in the order they are started: the slowest first, so that two
# workers end together.
ORDER = ("static", "hpa", "keda", "ray", "fleet")


def others(policy: str, variants: bool = False) -> list[str]:
    """The policies `--compare` replays beside `policy`, slowest first; `variants`: our policy's
    variants too (`simulator.run.VARIANTS`: for a scenario whose callers have an SDK client)."""
    return sorted(in_order(policy, variants), key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


def in_order(policy: str, variants: bool = False) -> list[str]:
    """The policies `--compare` replays beside `policy`, in the order its rows are made (ties in
    the ranking keep it)."""
    return [n for n in [*POLICIES, *(VARIANTS if variants else ())] if n != policy]


def fairness_jobs(sc: Scenario, policy: str, seed: int) -> tuple[list[str], list[Job]]:
    """The fairness runs the main replay is not already (`simulator.fairness.is_main_run`), as jobs."""
    runs = [run for run in fairness_runs(sc) if not is_main_run(sc, run)]
    return runs, [(fairness_run, (policy, seed, run)) for run in runs]


def fairness_rows_from(sc: Scenario, main: SimResult, replayed: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The fairness rows in their order: reused from the main replay, or as replayed."""
    return [reused_row(sc, main, run) or replayed[run] for run in fairness_runs(sc)]
