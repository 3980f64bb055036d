"""The fair line in `fleet simulate`: per-chain outcomes, and fifo against fair on one trace.

`flow_summary` reads one replay: chains completed, their completion time (arrival of the
chain's first call to the end of its last) p50/p99/mean, chains with a call refused or late,
the quiet keys' p99 wait in line, Jain's index over the flows backlogged through a window.
`fairness_rows` replays the same trace with every tier `fair`, then `fifo` (and, when the
scenario names its `flood_key`, `fair` without that key's calls: what the quiet keys see with
no flood); `fairness_checks` judges the scenario's `expect:` against them.
"""

from __future__ import annotations

import statistics
from typing import Any

from simulator.arrivals import Trace
from simulator.report import pct
from simulator.results import SimResult
from simulator.run import simulate
from simulator.scenario import Scenario

FAIRNESS_EXPECT = ("quiet_p99_vs_alone", "quiet_p99_wait_max_s", "quiet_p99_vs_fifo", "goodput_vs_fifo",
                   "chain_mean_vs_fifo", "chain_p99_vs_fifo", "jain_min")


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def flow_summary(r: SimResult, flood_key: str | None = None) -> dict[str, Any]:
    """One replay's chains and flows as one plain dict (see the module doc)."""
    times = r.chain_times or []
    failed = sum(c.get("timed_out", 0) + c.get("shed", 0) for c in r.chains.values())
    waits = r.key_waits or {}
    flood = f"key:{flood_key}" if flood_key else (max(waits, key=lambda k: len(waits[k])) if len(waits) > 1 else None)
    quiet = [w for k, ws in waits.items() if k != flood for w in ws]
    done = sum(o.completed for t in r.tiers.values() for o in t.outcomes)
    return {
        "fairness": r.fairness, "goodput_rps": round(done / r.scenario.duration_s, 4),
        "chains_completed": len(times), "chains_refused_or_late": failed,
        "chain_p50_s": _r(pct(times, 0.5)), "chain_p99_s": _r(pct(times, 0.99)),
        "chain_mean_s": _r(statistics.fmean(times)) if times else None,
        "quiet_keys": sorted(k.removeprefix("key:") for k in waits if k != flood),
        "quiet_p99_wait_s": _r(pct(quiet, 0.99), 4), "jain": _r(r.jain, 4),
    }


def fairness_runs(sc: Scenario) -> list[str]:
    """The runs `fairness_rows` holds: fair, fifo, and fair with no flood where the scenario
    names its `flood_key`."""
    return ["fair", "fifo", *(["fair, no flood"] if sc.spec.expect.get("flood_key") else [])]


def fairness_run(sc: Scenario, trace: Trace, policy: str, seed: int, run: str) -> dict[str, Any]:
    """One row of `fairness_rows`: the replay `run` names, summarised (a `simulator.parallel` job)."""
    flood = sc.spec.expect.get("flood_key")
    if run == "fair, no flood":
        alone = Trace([a for a in trace.arrivals if a.call.flow != f"key:{flood}"], trace.chains)
        return {"run": run, **flow_summary(simulate(sc, policy, seed, alone, fairness="fair"), flood)}
    return {"run": run, **flow_summary(simulate(sc, policy, seed, trace, fairness=run), flood)}


def is_main_run(sc: Scenario, run: str) -> bool:
    """Whether the run is the scenario's own replay: every tier already orders its classes as
    `run` says, and it replays the whole trace."""
    return run in ("fair", "fifo") and all(tc.fairness == run for tc in sc.cfg.tiers.values())


def reused_row(sc: Scenario, main: SimResult | None, run: str) -> dict[str, Any] | None:
    """The row of `run` from the main replay (the policy's, as configured), where it is that
    very replay (`is_main_run`); else None: it must be replayed."""
    if main is None or main.fairness is not None or not is_main_run(sc, run):
        return None
    return {"run": run, **flow_summary(main, sc.spec.expect.get("flood_key")), "fairness": run}


def fairness_rows(sc: Scenario, policy: str, seed: int, trace: Trace,
                  main: SimResult | None = None) -> list[dict[str, Any]]:
    """fair, fifo (and fair with no flood) on the same trace, one row each. `main`: the replay of
    `policy` on `trace` as configured, reused for the run it already is."""
    return [reused_row(sc, main, run) or fairness_run(sc, trace, policy, seed, run) for run in fairness_runs(sc)]


def fairness_checks(rows: list[dict[str, Any]], exp: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The fair line's `expect:` keys, judged on `fairness_rows`."""
    by = {row["run"]: row for row in rows}
    fair, fifo, alone = by["fair"], by["fifo"], by.get("fair, no flood")
    out: list[tuple[str, bool, str]] = []
    if "quiet_p99_vs_alone" in exp and alone is not None:
        # Waits are whole slots apart at best: a floor of 10 ms keeps "within 1.5x of nothing" judgeable.
        a, f = alone["quiet_p99_wait_s"] or 0.0, fair["quiet_p99_wait_s"] or 0.0
        out.append((f"quiet keys' p99 wait within {exp['quiet_p99_vs_alone']}x of theirs with no flood",
                    f <= exp["quiet_p99_vs_alone"] * max(a, 0.01), f"{f * 1000:.0f} ms vs {a * 1000:.0f} ms alone"))
    if "quiet_p99_wait_max_s" in exp:
        f = fair["quiet_p99_wait_s"]
        seen = "no quiet call" if f is None else f"{f * 1000:.0f} ms"
        if f is not None and alone and alone["quiet_p99_wait_s"] is not None:
            seen += f" ({alone['quiet_p99_wait_s'] * 1000:.0f} ms with no flood)"
        out.append((f"quiet keys' p99 wait at most {exp['quiet_p99_wait_max_s']} s with the flood",
                    f is not None and f <= exp["quiet_p99_wait_max_s"], seen))
    if "quiet_p99_vs_fifo" in exp and fair["quiet_p99_wait_s"] and fifo["quiet_p99_wait_s"]:
        x = fifo["quiet_p99_wait_s"] / fair["quiet_p99_wait_s"]
        out.append((f"quiet keys' p99 wait at least {exp['quiet_p99_vs_fifo']}x better than fifo",
                    x >= exp["quiet_p99_vs_fifo"], f"{x:.1f}x"))
    if "goodput_vs_fifo" in exp:
        out.append((f"goodput at least {exp['goodput_vs_fifo']}x fifo's",
                    fair["goodput_rps"] >= exp["goodput_vs_fifo"] * fifo["goodput_rps"] - 1e-9,
                    f"{fair['goodput_rps']:.2f}/s vs {fifo['goodput_rps']:.2f}/s"))
    if "chain_mean_vs_fifo" in exp and fair["chain_mean_s"] and fifo["chain_mean_s"]:
        x = fifo["chain_mean_s"] / fair["chain_mean_s"]
        out.append((f"mean chain completion at least {exp['chain_mean_vs_fifo']}x better than fifo",
                    x >= exp["chain_mean_vs_fifo"], f"{fair['chain_mean_s']:.2f} s vs {fifo['chain_mean_s']:.2f} s"
                    f" ({x:.2f}x)"))
    if "chain_p99_vs_fifo" in exp and fair["chain_p99_s"] is not None and fifo["chain_p99_s"] is not None:
        bound = exp["chain_p99_vs_fifo"]
        out.append(("chain completion p99 no worse than fifo's" if bound <= 1 else
                    f"chain completion p99 within {bound}x of fifo's",
                    fair["chain_p99_s"] <= bound * fifo["chain_p99_s"],
                    f"{fair['chain_p99_s']:.2f} s vs {fifo['chain_p99_s']:.2f} s"))
    if "jain_min" in exp:
        j = fair["jain"]
        out.append((f"Jain's index over backlogged flows at least {exp['jain_min']}", j is not None and j >=
                    exp["jain_min"], "no window with two flows backlogged through it" if j is None else f"{j:.3f}"))
    return out


def render_fairness(rows: list[dict[str, Any]]) -> str:
    head = ["run", "goodput/s", "chains done", "refused/late", "chain p50 s", "chain p99 s", "chain mean s",
            "quiet p99 wait ms", "Jain"]

    def f(x: Any, scale: float = 1.0, nd: int = 2) -> str:
        return "-" if x is None else f"{x * scale:.{nd}f}"

    body = [[r["run"], f(r["goodput_rps"]), str(r["chains_completed"]), str(r["chains_refused_or_late"]),
             f(r["chain_p50_s"]), f(r["chain_p99_s"]), f(r["chain_mean_s"]), f(r["quiet_p99_wait_s"], 1000, 0),
             f(r["jain"], 1.0, 3)] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)
