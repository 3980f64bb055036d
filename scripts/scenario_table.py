"""Print the comparison table of every scenario in configs/scenarios/ as Markdown (for docs/results.md).

    python scripts/scenario_table.py            # every scenario, every policy (tens of minutes)
    python scripts/scenario_table.py a.yaml ... # only these

Each row is one policy on one scenario, from `fleet simulate --compare --json`'s figures:
replica-hours, goodput, committed calls missed, flaps, the clairvoyant served bound (the
calls that policy served on time, with the floors) and the ratio to it, the ratio to the
"every call + floors" bound, ours to the cheapest baseline (fewest replica-hours), the
highest budget use (spent / budget of a window), and per class the share of calls served
within their objective (`simulator.objectives`: the deadline, else the class's wait limit).
"""

from __future__ import annotations

import sys
from pathlib import Path

from simulator.arrivals import build_trace
from simulator.bound import hours, served_bound
from simulator.compare import bound, others, policy_summary
from simulator.objectives import cell
from simulator.parallel import SideJobs
from simulator.report import checks, compare_rows, summarize, with_bounds
from simulator.run import POLICIES, simulate
from simulator.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent


def table(path: Path) -> list[str]:
    """One scenario's rows: every policy, the every call + floors bound, the expect: checks."""
    sc = load_scenario(path)
    seed = sc.spec.seed
    trace = build_trace(sc, seed)
    names = others("fleet")  # the baselines, replayed beside ours (`simulator.parallel`)
    with SideJobs(sc, trace, [*((policy_summary, (n, seed)) for n in names), (bound, (3, True))]) as side:
        fleet = simulate(sc, "fleet", seed, trace)
        *got, floors = side.collect()
    summaries = {"fleet": (summarize(fleet, timeline=False), hours(served_bound(sc, trace, fleet))),
                 **dict(zip(names, got, strict=True))}
    rows = compare_rows([with_bounds(s, h, hours(floors)) for s, h in (summaries[n] for n in POLICIES)],
                        None, None, floors)
    judged = checks(fleet, summaries["fleet"][1], rows)
    # The best baseline: the fewest replica-hours of any (whatever its goodput: the stricter test).
    ours = next(r for r in rows if r["policy"] == "fleet")
    peers = [r for r in rows if r["rank"] is not None and r["policy"] != "fleet"]
    best = min(peers, key=lambda r: r["replica_hours"], default=None)
    out = []
    for r in rows:
        if r["rank"] is None and not r["policy"].endswith("floors"):
            continue
        use = r["budget_use"] or {}
        top = max(use, key=use.__getitem__) if use else None
        vs_best = (f"{r['replica_hours'] / best['replica_hours']:.2f} ({best['policy']})"
                   if r is ours and best and best["replica_hours"] > 0 else "-")
        cells = [sc.name, r["policy"], f"{r['replica_hours']:.2f}",
                 "-" if r["goodput_rps"] is None else f"{r['goodput_rps']:.2f}",
                 "-" if r["goodput_rps"] is None else str(r["committed_missed"]),
                 "-" if r["flaps"] is None else str(r["flaps"]),
                 "-" if r["served_bound_replica_hours"] is None else f"{r['served_bound_replica_hours']:.2f}",
                 "-" if r["bound_ratio"] is None else f"{r['bound_ratio']:.2f}",
                 "-" if r["bound_ratio_every_call"] is None else f"{r['bound_ratio_every_call']:.2f}",
                 vs_best, f"{use[top]:.0%} {top}" if top else "-", cell(r.get("objectives"))]
        out.append("| " + " | ".join(cells) + " |")
    failed = [f"{n}: {seen}" for n, ok, seen in judged if not ok]
    out.append(f"| {sc.name} | *expect:* | " + ("all pass" if not failed else "FAIL " + "; ".join(failed))
               + " |" + " |" * 9)
    return out


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted((ROOT / "configs" / "scenarios").glob("*.yaml"))
    print("| scenario | policy | replica-h | goodput/s | committed missed | flaps | served bound h "
          "| x served bound | x every call + floors | x best baseline | budget use (highest) "
          "| within objective % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        for line in table(p):
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
