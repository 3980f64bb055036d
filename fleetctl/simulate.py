"""`fleet simulate`: replay a scenario under a policy (or all of them), print or --json the outcome."""

from __future__ import annotations

import sys
from typing import Any

import click

from simulator.arrivals import build_trace
from simulator.bound import hours, served_bound
from simulator.client_spec import has_clients
from simulator.compare import bound, fairness_jobs, fairness_rows_from, in_order, others, policy_summary
from simulator.fairness import FAIRNESS_EXPECT, fairness_checks, flow_summary, render_fairness
from simulator.parallel import Job, SideJobs
from simulator.progress import Progress
from simulator.report import (
    checks,
    compare_rows,
    render_checks,
    render_compare,
    render_summary,
    summarize,
    with_bounds,
)
from simulator.run import UnknownPolicy, make_policy, simulate
from simulator.scenario import ScenarioError, load_scenario


def _scenario(path: str, policy: str, affinity: bool, degrade: bool = True, degrade_from: str | None = None) -> Any:
    """The scenario to replay (affinity off, degrade rules off or taken from another config,
    where asked), or None after saying what is wrong."""
    from fleet.config import ConfigError, load_config
    from fleet.degrade_config import degrade_problems

    try:
        sc = load_scenario(path)
        make_policy(policy)
        if degrade_from is not None:  # each tier of the scenario gets the rule of its namesake there
            rules = {t: tc.degrade for t, tc in load_config(degrade_from).tiers.items()}
            for t, tc in sc.cfg.tiers.items():
                tc.degrade = rules.get(t)
            if bad := degrade_problems(sc.cfg.tiers):
                raise ScenarioError(f"--degrade-from {degrade_from}: " + "; ".join(bad))
    except (ScenarioError, UnknownPolicy, ConfigError) as e:
        click.echo(f"fleet: {e}", err=True)
        return None
    if not affinity:  # the comparison: calls go to the least busy replica, wherever their prefix is cached
        for tc in sc.cfg.tiers.values():
            tc.affinity = tc.affinity.model_copy(update={"enabled": False})
    if not degrade:  # the comparison: a call its tier refuses is shed, never served by a smaller tier
        for tc in sc.cfg.tiers.values():
            tc.degrade = None
    return sc


def _bound_json(bound: dict[str, Any]) -> dict[str, Any]:
    """The clairvoyant bound as --json writes it: totals, then each tier."""
    return {
        "replica_hours": round(sum(b.replica_seconds for b in bound.values()) / 3600, 3),
        "spend_usd": round(sum(b.spend_usd for b in bound.values()), 4),
        "tiers": {t: {"replica_hours": round(b.replica_seconds / 3600, 3),
                      "ready_hours": round(b.ready_s / 3600, 3),
                      "cold_start_hours": round(b.starting_s / 3600, 3), "peak_replicas": b.peak_replicas,
                      "committed_calls": b.committed_calls, "infeasible_calls": b.infeasible_calls,
                      "spend_usd": round(b.spend_usd, 4)} for t, b in bound.items()},
    }


def _wants_fairness(sc: Any, compare: bool) -> bool:
    """Fair against fifo is replayed with --compare, or when the scenario expects it."""
    return compare or any(k in sc.spec.expect for k in FAIRNESS_EXPECT)


def _fairness(sc: Any, main: Any,
              rows: list[dict[str, Any]] | None) -> tuple[dict[str, Any], list[tuple[str, bool, str]]]:
    """The chains' outcomes (`flows`) and, where replayed, fair against fifo on the same trace
    (`fairness_compare`) with its checks (docs/fair-line.md)."""
    exp = sc.spec.expect
    out: dict[str, Any] = {"flows": flow_summary(main, exp.get("flood_key"))}
    if rows is None:
        return out, []
    out["fairness_compare"] = rows
    return out, fairness_checks(rows, exp)


def _replays(sc: Any, policy: str, seed: int, trace: Any, compare: bool,
             plot_path: str | None) -> tuple[Any, list[Any], dict[str, Any]]:
    """The main replay (here, with its progress on a terminal) and what goes beside it, in
    worker processes (`simulator.parallel`): the other policies summarised, the fairness runs,
    the clairvoyant bounds. Returns the main result, the others' results (only with --plot,
    which draws them: then they are replayed here) and the side results by name."""
    names = others(policy, has_clients(sc.spec)) if compare else []
    fair_runs, fair_jobs = fairness_jobs(sc, policy, seed) if _wants_fairness(sc, compare) else ([], [])
    bounds = {"floors": (3, True), **({"committed": (0, False)} if compare or policy == "fleet" else {}),
              **({"all": (3, False)} if compare else {})}
    jobs: list[Job] = [*fair_jobs, *((policy_summary, (n, seed)) for n in names if not plot_path),
                       *((bound, args) for args in bounds.values())]
    keys = [*(f"fair:{r}" for r in fair_runs), *(f"policy:{n}" for n in names if not plot_path),
            *(f"bound:{b}" for b in bounds)]
    progress = Progress(sc, policy)
    try:
        with SideJobs(sc, trace, jobs) as side:
            progress.watch(side.done, len(jobs))
            main = simulate(sc, policy, seed, trace, progress=progress)
            full = ([simulate(sc, n, seed, trace, progress=progress) for n in in_order(policy, has_clients(sc.spec))]
                    if plot_path else [])
            got = dict(zip(keys, side.collect(progress.side), strict=True))
    finally:
        progress.close()
    return main, full, got


def _echo_flows(doc: dict[str, Any]) -> None:
    fl = doc["flows"]
    click.echo(f"chains: {fl['chains_completed']} completed (p50 {fl['chain_p50_s']} s, p99 {fl['chain_p99_s']} s), "
               f"{fl['chains_refused_or_late']} with a call refused or late")
    if "fairness_compare" in doc:
        click.echo("")
        click.echo("fair against fifo within each class (same trace, same seed)")
        click.echo(render_fairness(doc["fairness_compare"]))


def run_simulate(path: str, *, policy: str = "fleet", compare: bool = False, as_json: bool = False,
                 plot_path: str | None = None, seed: int | None = None, timeline: int | None = 200,
                 affinity: bool = True, degrade: bool = True, degrade_from: str | None = None) -> int:
    """Replay a scenario; print the outcome (or JSON); return the exit status.

    Exit 1 when the scenario's `expect:` checks fail, so a scenario can gate a
    config change in CI; 2 for a bad scenario or policy name.
    """
    sc = _scenario(path, policy, affinity, degrade, degrade_from)
    if sc is None:
        return 2
    seed = sc.spec.seed if seed is None else seed
    trace = build_trace(sc, seed)
    main, full, side = _replays(sc, policy, seed, trace, compare, plot_path)
    bound, bound_all = side.get("bound:committed"), side.get("bound:all")
    bound_floors = side["bound:floors"]
    floors_hours = hours(bound_floors)
    served = served_bound(sc, trace, main)
    summary = with_bounds(summarize(main), hours(served), floors_hours)
    rows = None
    if compare:
        rest = ([(summarize(o, timeline=False), hours(served_bound(sc, trace, o))) for o in full] if plot_path
                else [side[f"policy:{n}"] for n in in_order(policy, has_clients(sc.spec))])
        rows = compare_rows([summary, *(with_bounds(s, h, floors_hours) for s, h in rest)],
                            bound, bound_all, bound_floors)
    fair_rows = (fairness_rows_from(sc, main, {k.removeprefix("fair:"): v for k, v in side.items()
                                               if k.startswith("fair:")})
                 if _wants_fairness(sc, compare) else None)
    flows, fair_checks = _fairness(sc, main, fair_rows)
    judged = checks(main, hours(served), rows) + fair_checks
    doc: dict[str, Any] = {**summary, **flows,
                           "checks": [{"check": n, "passed": ok, "seen": seen} for n, ok, seen in judged]}
    if bound is not None:
        doc["clairvoyant_bound"] = _bound_json(bound)
    doc["clairvoyant_served_bound"] = {
        "replica_hours": round(hours(served), 3),
        "spend_usd": round(sum(b.spend_usd for b in served.values()), 4),
        "tiers": {t: {"replica_hours": round(b.replica_seconds / 3600, 3), "calls": b.committed_calls,
                      "peak_replicas": b.peak_replicas} for t, b in served.items()},
    }
    if rows is not None:
        doc["compare"] = rows
    if plot_path:
        from simulator.plot import plot

        plot(main, plot_path, full or None)
    if as_json:
        import orjson

        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render_summary(summary, timeline_limit=timeline))
        if bound is not None and not compare:
            cb = doc["clairvoyant_bound"]
            click.echo(f"clairvoyant lower bound: {cb['replica_hours']:.2f} replica-hours, ${cb['spend_usd']:.2f} "
                       "(fewest that serve every committed call on time, knowing the trace and the cold start)")
        if compare:
            click.echo("")
            click.echo("compare (same trace, same seed; ranked by goodput, then replica-hours and spend)")
            click.echo(render_compare(doc["compare"]))
            click.echo("clairvoyant rows: replica-hours below which no schedule serves those calls on time, "
                       "knowing the trace and the cold start (the first row is the lower bound of the issue: "
                       "committed calls, no floor). x served bound: replica-hours over the bound for the very "
                       "calls that policy served on time, with the floors (no policy can go below 1); "
                       "x every call: over the every call + floors bound (a policy that sheds can)")
        if judged:
            click.echo("")
            click.echo("checks (the scenario's expect:)")
            click.echo(render_checks(judged))
        if plot_path:
            click.echo(f"\nplot written to {plot_path}")
    sys.stdout.flush()
    return 0 if all(ok for _, ok, _ in judged) else 1
