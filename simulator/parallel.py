"""Replays beside the main one, in worker processes: `--compare`'s other policies, the fairness
runs and the clairvoyant bounds.

Each job is a module-level function called as `fn(scenario, trace, *args)`; what it returns
must pickle (a summary, a bound), not a `SimResult`. The workers are forked after the
trace is drawn, so they share it without copying it through a pipe, and each replay is
exactly the one the same call makes in this process (same scenario, trace, seed). Where
there is one CPU, or the platform does not fork, the jobs run here, one after the other,
when collected: the same results, later.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.pool import AsyncResult, Pool
from typing import Any

from simulator.arrivals import Trace
from simulator.scenario import Scenario

Job = tuple[Callable[..., Any], tuple[Any, ...]]

# The scenario and trace the forked workers read (set before the fork, never sent).
_SHARED: tuple[Scenario, Trace] | None = None


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    assert _SHARED is not None, "a worker forked without the shared scenario"
    return fn(*_SHARED, *args)


class SideJobs:
    """Jobs started now in worker processes (or kept to run here); `collect` returns their results
    in order. Use as a context manager: the workers end with it."""

    def __init__(self, sc: Scenario, trace: Trace, jobs: list[Job], workers: int | None = None) -> None:
        global _SHARED
        self.sc, self.trace, self.jobs = sc, trace, jobs
        n = min(len(jobs), cpus() if workers is None else workers)
        self.pool: Pool | None = None
        self.pending: list[AsyncResult[Any]] = []
        if n > 1 and "fork" in mp.get_all_start_methods():
            _SHARED = (sc, trace)
            self.pool = mp.get_context("fork").Pool(n)
            _SHARED = None  # the workers hold their copy; this process needs none
            self.pending = [self.pool.apply_async(_call, (fn, args)) for fn, args in jobs]

    def __enter__(self) -> SideJobs:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def done(self) -> int:
        """How many have ended (0 while they run here, until collected)."""
        return sum(1 for p in self.pending if p.ready())

    def collect(self, on_done: Callable[[int, int], None] | None = None) -> list[Any]:
        """Every job's result, in the order given; `on_done(done, total)` as each ends."""
        total = len(self.jobs)
        if self.pool is None:
            out = []
            for i, (fn, args) in enumerate(self.jobs, 1):
                out.append(fn(self.sc, self.trace, *args))
                if on_done:
                    on_done(i, total)
            return out
        for p in self.pending:
            while not p.ready():
                p.wait(0.5)
                if on_done:
                    on_done(self.done(), total)
        if on_done:
            on_done(total, total)
        return [p.get() for p in self.pending]
