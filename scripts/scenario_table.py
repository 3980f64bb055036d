"""Print the comparison table of every scenario in configs/scenarios/ as Markdown (for docs/results.md).

    python scripts/scenario_table.py            # every scenario, every policy (several minutes)
    python scripts/scenario_table.py a.yaml ... # only these

Each row is one policy on one scenario, from `fleet simulate --compare --json`'s figures:
replica-hours, goodput, committed calls missed, flaps, the ratio to the clairvoyant
"every call + floors" bound and the highest budget use (spent / budget of a window).
"""

from __future__ import annotations

import sys
from pathlib import Path

from simulator.arrivals import build_trace
from simulator.bound import clairvoyant_bound
from simulator.report import checks, compare_rows, summarize
from simulator.run import POLICIES, simulate
from simulator.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent


def table(path: Path) -> list[str]:
    sc = load_scenario(path)
    trace = build_trace(sc, sc.spec.seed)
    results = {name: simulate(sc, name, sc.spec.seed, trace) for name in POLICIES}
    floors = clairvoyant_bound(sc, trace, max_class=3, keep_floor=True)
    hours = sum(b.replica_seconds for b in floors.values()) / 3600
    rows = compare_rows([summarize(r, timeline=False) for r in results.values()], None, None, floors)
    judged = checks(results["fleet"], hours, rows)
    out = []
    for r in rows:
        if r["rank"] is None and not r["policy"].endswith("floors"):
            continue
        use = r["budget_use"] or {}
        top = max(use, key=use.__getitem__) if use else None
        out.append(f"| {sc.name} | {r['policy']} | {r['replica_hours']:.2f} | "
                   + ("-" if r["goodput_rps"] is None else f"{r['goodput_rps']:.2f}") + " | "
                   + ("-" if r["goodput_rps"] is None else str(r["committed_missed"])) + " | "
                   + ("-" if r["flaps"] is None else str(r["flaps"])) + " | "
                   + ("-" if r["bound_ratio"] is None else f"{r['bound_ratio']:.2f}") + " | "
                   + (f"{use[top]:.0%} {top}" if top else "-") + " |")
    failed = [f"{n}: {seen}" for n, ok, seen in judged if not ok]
    out.append(f"| {sc.name} | *expect:* | " + ("all pass" if not failed else "FAIL " + "; ".join(failed))
               + " | | | | | |")
    return out


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted((ROOT / "configs" / "scenarios").glob("*.yaml"))
    print("| scenario | policy | replica-h | goodput/s | committed missed | flaps | x bound | budget use (highest) |")
    print("|---|---|---|---|---|---|---|---|")
    for p in paths:
        for line in table(p):
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
