"""`fleet simulate`: replay a scenario under a policy (or all of them), print or --json the outcome."""

from __future__ import annotations

import sys
from typing import Any

import click

from simulator.arrivals import build_trace
from simulator.bound import clairvoyant_bound, hours, served_bound
from simulator.fairness import FAIRNESS_EXPECT, fairness_checks, fairness_rows, flow_summary, render_fairness
from simulator.report import (
    checks,
    compare_rows,
    render_checks,
    render_compare,
    render_summary,
    summarize,
    with_bounds,
)
from simulator.run import POLICIES, UnknownPolicy, make_policy, simulate
from simulator.scenario import ScenarioError, load_scenario


def _scenario(path: str, policy: str, affinity: bool) -> Any:
    """The scenario to replay (affinity off where asked), or None after saying what is wrong."""
    try:
        sc = load_scenario(path)
        make_policy(policy)
    except (ScenarioError, UnknownPolicy) as e:
        click.echo(f"fleet: {e}", err=True)
        return None
    if not affinity:  # the comparison: calls go to the least busy replica, wherever their prefix is cached
        for tc in sc.cfg.tiers.values():
            tc.affinity = tc.affinity.model_copy(update={"enabled": False})
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


def _fairness(sc: Any, policy: str, seed: int, trace: Any, main: Any,
              compare: bool) -> tuple[dict[str, Any], list[tuple[str, bool, str]]]:
    """The chains' outcomes (`flows`) and, with --compare or when the scenario expects it, fair
    against fifo on the same trace (`fairness_compare`) with its checks (docs/fair-line.md)."""
    exp = sc.spec.expect
    out: dict[str, Any] = {"flows": flow_summary(main, exp.get("flood_key"))}
    if not (compare or any(k in exp for k in FAIRNESS_EXPECT)):
        return out, []
    out["fairness_compare"] = rows = fairness_rows(sc, policy, seed, trace)
    return out, fairness_checks(rows, exp)


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
                 affinity: bool = True) -> int:
    """Replay a scenario; print the outcome (or JSON); return the exit status.

    Exit 1 when the scenario's `expect:` checks fail, so a scenario can gate a
    config change in CI; 2 for a bad scenario or policy name.
    """
    sc = _scenario(path, policy, affinity)
    if sc is None:
        return 2
    seed = sc.spec.seed if seed is None else seed
    trace = build_trace(sc, seed)
    main = simulate(sc, policy, seed, trace)
    others = [simulate(sc, name, seed, trace) for name in POLICIES if name != policy] if compare else []
    bound = clairvoyant_bound(sc, trace) if compare or policy == "fleet" else None
    bound_all = clairvoyant_bound(sc, trace, max_class=3) if compare else None
    bound_floors = clairvoyant_bound(sc, trace, max_class=3, keep_floor=True)
    floors_hours = hours(bound_floors)
    served = served_bound(sc, trace, main)
    summary = with_bounds(summarize(main), hours(served), floors_hours)
    rows = None
    if compare:
        rows = compare_rows([summary, *(with_bounds(summarize(o, timeline=False), hours(served_bound(sc, trace, o)),
                                                    floors_hours) for o in others)],
                            bound, bound_all, bound_floors)
    flows, fair_checks = _fairness(sc, policy, seed, trace, main, compare)
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

        plot(main, plot_path, others or None)
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
