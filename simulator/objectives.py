"""Objectives reported: per class, the share of its calls served within their objective.

A call's objective is its deadline when it carries one (its own, its chain's, or its
class's in the scenario): a completed call met it, since one past its deadline is
aborted or expires. A call with no deadline stated (only the fleet's
`default_deadline_ms` bounds it) is judged on its class's wait limit on its tier
(`wait_limit_s`): completed, having waited in line no longer than that. A call shed,
expired or aborted missed its objective. The share is over every call of the class
that arrived, on every tier.

The goals (issue 40): committed >= 99.9% and interactive >= 99% under the fleet's policy.
"""

from __future__ import annotations

import math
from typing import Any

from fleet.config import CLASSES
from simulator.results import SimResult

GOALS = {"committed": 0.999, "interactive": 0.99}


def attainment(r: SimResult) -> dict[str, dict[str, Any]]:
    """Per class that had calls: arrived, served within objective, the share, what the objective
    was ("deadline", "wait limit", or "deadline or wait limit" when both kinds arrived), and,
    where the class has a goal, the goal and whether it was met."""
    out: dict[str, dict[str, Any]] = {}
    for i, cls in enumerate(CLASSES):
        outcomes = [t.outcomes[i] for t in r.tiers.values()]
        arrived = sum(o.arrived for o in outcomes)
        if not arrived:
            continue
        within = sum(o.within_objective for o in outcomes)
        by_wait = sum(o.wait_objective for o in outcomes)
        kind = "deadline" if not by_wait else "wait limit" if by_wait == arrived else "deadline or wait limit"
        row: dict[str, Any] = {"calls": arrived, "within": within, "share": round(within / arrived, 6),
                               "objective": kind}
        if cls in GOALS:
            row["goal"] = GOALS[cls]
            row["met"] = within / arrived >= GOALS[cls]
        out[cls] = row
    return out


def shares(objectives: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Class -> share within objective (the compare rows keep only this)."""
    return {cls: v["share"] for cls, v in objectives.items()}


def cell(shares_by_class: dict[str, float] | None) -> str:
    """The shares as one table cell, committed first: "c 100 / i 99.6 / s 87.1" (in %, classes
    that had calls); "-" for none (a bound's row)."""
    if not shares_by_class:
        return "-"
    return " / ".join(f"{cls[0]} {_pct(shares_by_class[cls])}" for cls in CLASSES if cls in shares_by_class)


def _pct(share: float) -> str:
    """A share in %, cut (not rounded) to one decimal, so a share below a goal never reads as
    the goal (99.89% reads 99.8); whole when it is (100)."""
    tenths = math.floor(1000 * share + 1e-9)
    return f"{tenths // 10}" if tenths % 10 == 0 else f"{tenths / 10:.1f}"


def render(objectives: dict[str, dict[str, Any]]) -> str:
    """One line for a terminal: each class's share, its objective, and its goal where it has one."""
    parts = []
    for cls, v in objectives.items():
        goal = ""
        if "goal" in v:
            goal = f", goal {100 * v['goal']:g}%: {'met' if v['met'] else 'MISSED'}"
        parts.append(f"{cls} {_pct(v['share'])}% of {v['calls']} ({v['objective']}{goal})")
    return "within objective: " + "; ".join(parts)
