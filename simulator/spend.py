"""The tier budget governor in simulated time, and the report of each budget window's spend.

As live (`fleet.governor`), it runs every tick for every tier, whatever the
policy (baselines ignore what it says, but their spend is judged against the
same windows): spent per window, token burn and replicas billing in, the
policy's `judge` out. Only where spend comes from differs: a running total
marked at each tick instead of the ledger.
"""

from __future__ import annotations

from typing import Any

from fleet.policy import BudgetObservation, BudgetView, judge, token_burn_since, token_burn_usd_per_s
from fleet.policy.tier_budget import budget_lead_s
from simulator.scenario import Scenario
from simulator.state import TierSim


def govern(sc: Scenario, tier: TierSim, t: float, tick_s: float, startup_s: float) -> BudgetView:
    """Judge the tier at `t` seconds into the replay; remembers the windows it saw."""
    now = sc.epoch(t)
    burn = 0.0
    if tier.usd_per_token:
        since = token_burn_since(now)
        burn = token_burn_usd_per_s(tier.token_usd - tier.token_usd_at(since - sc.start_epoch, tick_s), now)

    def judged(starts: dict[str, float]) -> BudgetView:
        spent = {name: tier.spend_usd - tier.spend_at(s0 - sc.start_epoch, tick_s) for name, s0 in starts.items()}
        return judge(tier.tc, BudgetObservation(now=now, replicas=tier.alive(), spent_usd=spent,
                                                token_burn_usd_per_s=burn),
                     lead_s=budget_lead_s(tier.tc, startup_s))

    # The windows in force rarely change between ticks: judge with last tick's, and
    # again only when the judgement shows a window has opened or closed.
    view = judged(tier.window_starts)
    starts = {w.name: w.start for w in view.windows}
    if starts != tier.window_starts:
        tier.window_starts = starts
        view = judged(starts)
    for w in view.windows:
        tier.windows_seen[(w.name, w.start)] = (w.end, w.budget_usd)
    tier.budget_view = view
    return view


def budget_report(sc: Scenario, tiers: dict[str, TierSim], tick_s: float) -> dict[str, dict[str, Any]]:
    """Per tier, each budget window the replay touched: its budget and what was spent in it."""
    out: dict[str, dict[str, Any]] = {}
    end = sc.duration_s
    for tier in tiers.values():
        rows: dict[str, Any] = {}
        for (name, start), (w_end, usd) in sorted(tier.windows_seen.items(), key=lambda kv: kv[0][1]):
            s0 = start - sc.start_epoch
            s1 = min(w_end - sc.start_epoch, end)
            spent = (tier.spend_usd if s1 >= end else tier.spend_at(s1, tick_s)) - tier.spend_at(s0, tick_s)
            key = name if name not in rows else f"{name}@{sc.clock(s0)}"
            # The governor acts once a tick: a window is within its budget when it passed it by
            # no more than one tick of the tier's peak burn (the same slack for every policy).
            tick_usd = tier.peak_replicas * tier.tc.hourly_usd / 3600 * tick_s
            rows[key] = {"budget_usd": usd, "spent_usd": spent, "start": sc.clock(max(s0, 0.0)),
                         "from_before_replay": s0 < 0, "ended": s1 < end, "over_usd": max(0.0, spent - usd),
                         "tick_burn_usd": tick_usd, "within": spent <= usd + tick_usd + 1e-9}
        out[tier.name] = rows
    return out
