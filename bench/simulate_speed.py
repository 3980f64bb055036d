"""How fast `fleet simulate` replays: two simulated hours of the market-open scenario at its peak rates.

Every arrival process and chain of configs/scenarios/market-open.yaml runs at the highest
rate its curve reaches (bursts included), for two hours, under our policy. The target
is under 30 s of wall time on a 2-core machine.

    .venv/bin/python bench/simulate_speed.py [--policy fleet] [--hours 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

from simulator.arrivals import build_trace
from simulator.run import simulate
from simulator.scenario import parse_scenario

SCENARIO = Path(__file__).resolve().parent.parent / "configs" / "scenarios" / "market-open.yaml"


def at_peak(hours: float) -> dict:
    raw = yaml.safe_load(SCENARIO.read_text())
    sc = parse_scenario(raw)
    for spec, proc in [*zip(raw["arrivals"], sc.spec.arrivals, strict=True),
                       *zip(raw["chains"], sc.spec.chains, strict=True)]:
        spec["rate"] = max(r for _, r in sc.rate_points(proc))
        spec.pop("bursts", None)
    raw["duration"] = hours * 3600
    raw.pop("expect", None)
    return raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="fleet")
    ap.add_argument("--hours", type=float, default=2.0)
    args = ap.parse_args()
    sc = parse_scenario(at_peak(args.hours))
    t0 = time.perf_counter()
    trace = build_trace(sc)
    t1 = time.perf_counter()
    r = simulate(sc, args.policy, trace=trace)
    t2 = time.perf_counter()
    calls = sum(o.arrived for t in r.tiers.values() for o in t.outcomes)
    print(f"{args.hours:g} simulated hours at peak rates, policy {args.policy}: {calls} calls, {r.events} events")
    print(f"trace {t1 - t0:.1f} s + replay {t2 - t1:.1f} s = {t2 - t0:.1f} s wall "
          f"({calls / (t2 - t0):,.0f} calls/s)")
    # The baseline is the clock itself: live traffic takes the simulated time to play out.
    simulated = args.hours * 3600
    print(f"ratio to real time: {simulated / (t2 - t0):,.0f}x faster than live "
          f"(goal: 2 h in under 30 s, {simulated / 30:,.0f}x)")


if __name__ == "__main__":
    main()
