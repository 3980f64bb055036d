"""How fast `fleet simulate` answers, against the same replays of an earlier commit, in one run.

Three measurements, each a fresh process (import, trace, replay, bounds: what an operator waits for):

- `single`: `fleet simulate configs/scenarios/market-open.yaml --json` (goal: 8 s or less);
- `compare`: the same with `--compare`: four baselines, the fifo run and the bounds (goal: 20 s);
- `peak`: two simulated hours of market-open at the highest rate each curve reaches (~0.9 M
  calls), one policy, in process (the replay alone).

`--before REF` runs each again on the tree of commit REF (`git archive`, into a temporary
directory, with this virtualenv; or a directory holding a tree), interleaved with this tree's,
and prints after / before: the baseline comes from the same run, under the same load. Wall time
and CPU time (this process's children, their workers included) are both printed: on a shared
machine the CPU time is the steadier figure.

    .venv/bin/python bench/simulate_speed.py [--before REF] [--only single,compare,peak] [--hours 2]

Measured on the 2-core development box, loaded by other work (load 3-5), against the commit
before the replays were made faster (issue 40): see docs/results.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = "configs/scenarios/market-open.yaml"
GOALS_S = {"single": 8.0, "compare": 20.0}

# Two simulated hours at peak rates, in the tree it runs in (only APIs both trees have).
PEAK = """
import sys, time, yaml
from simulator.arrivals import build_trace
from simulator.run import simulate
from simulator.scenario import parse_scenario
raw = yaml.safe_load(open("configs/scenarios/market-open.yaml"))
sc = parse_scenario(raw)
for spec, proc in [*zip(raw["arrivals"], sc.spec.arrivals), *zip(raw["chains"], sc.spec.chains)]:
    spec["rate"] = max(r for _, r in sc.rate_points(proc))
    spec.pop("bursts", None)
raw["duration"] = float(sys.argv[1]) * 3600
raw.pop("expect", None)
sc = parse_scenario(raw)
r = simulate(sc, sys.argv[2], trace=build_trace(sc))
print(sum(o.arrived for t in r.tiers.values() for o in t.outcomes), r.events)
"""


def commands(what: str, hours: float, policy: str) -> list[str]:
    py = sys.executable
    if what == "single":
        return [py, "-m", "fleetctl", "simulate", SCENARIO, "--policy", policy, "--json"]
    if what == "compare":
        return [py, "-m", "fleetctl", "simulate", SCENARIO, "--policy", policy, "--compare", "--json"]
    return [py, "-c", PEAK, str(hours), policy]


def timed(cmd: list[str], tree: Path) -> tuple[float, float, str]:
    """Wall and CPU seconds of `cmd` run in `tree` (its own modules first), and its last line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                         text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if out.returncode not in (0, 1):  # 1: the scenario's expect: checks, which a bench does not judge
        raise SystemExit(f"{' '.join(cmd[:4])} failed in {tree}:\n{out.stderr[-2000:]}")
    return wall, cpu, (out.stdout.strip().splitlines() or [""])[-1]


def tree_at(ref: str) -> Path:
    """The files of commit `ref`, in a temporary directory (a directory given: that tree as it is)."""
    if Path(ref).is_dir():
        return Path(ref).resolve()
    data = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    dest = Path(tempfile.mkdtemp(prefix="simulate-speed-"))
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", metavar="REF", help="also run each on the tree of this commit (or directory)")
    ap.add_argument("--only", default="single,compare,peak")
    ap.add_argument("--policy", default="fleet")
    ap.add_argument("--hours", type=float, default=2.0)
    args = ap.parse_args()
    old = tree_at(args.before) if args.before else None
    print(f"{'':8} {'this tree':>22}" + (f" {args.before[:12]:>22} {'after/before':>14}" if old else "")
          + "  goal")
    for what in args.only.split(","):
        cmd = commands(what, args.hours, args.policy)
        now = timed(cmd, ROOT)
        line = f"{what:8} {now[0]:8.1f} s wall {now[1]:6.1f} s CPU"
        if old is not None:
            then = timed(cmd, old)
            line += f" {then[0]:8.1f} s wall {then[1]:6.1f} s CPU {now[0] / then[0]:6.2f}x wall"
        goal = GOALS_S.get(what)
        line += f"  {'<= ' + format(goal, 'g') + ' s: ' + ('met' if now[0] <= goal else 'MISSED') if goal else ''}"
        if what == "peak":
            calls, events = now[2].split()
            line += f"  ({int(calls):,} calls, {int(events):,} events; {args.hours * 3600 / now[0]:,.0f}x real time)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
