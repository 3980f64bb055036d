"""What a replay shows: outcome tables, the decision timeline, JSON, the compare table, checks.

`summarize` turns a `SimResult` into one plain dict (what `--json` prints);
the `render_*` functions print it for a terminal. Goodput is the vLLM bench
definition: requests that met their deadline, per second of the replay
(a completed call always met it: one past its deadline is aborted or expires).
"""

from __future__ import annotations

import math
from typing import Any

from fleet.config import CLASSES
from fleet.policy.tier_budget import cost_per_useful_million
from simulator import objectives
from simulator.bound import TierBound
from simulator.clients import callers_compare, render_callers
from simulator.results import SimResult


def pct(values: list[float], q: float, *, ordered: bool = False) -> float | None:
    """Nearest-rank percentile; None for no values. `ordered`: `values` are sorted already."""
    if not values:
        return None
    s = values if ordered else sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _p50_p99(values: list[float], nd: int = 3) -> dict[str, float | None]:
    """`pct` at 0.5 and 0.99, rounded, on one sort (a class's waits are up to ~10^5 values)."""
    s = sorted(values)
    return {"p50": _num(pct(s, 0.5, ordered=True), nd), "p99": _num(pct(s, 0.99, ordered=True), nd)}


def _num(x: float | None, nd: int = 3) -> float | None:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return None
    return round(x, nd)


def flaps(r: SimResult) -> dict[str, int]:
    """Per tier, scale-outs that came within the tier's `scale_in_hold_s` after a scale-in:
    capacity given back and bought again, each paying a cold start. Judged the same way
    for every policy, on its own timeline."""
    out: dict[str, int] = dict.fromkeys(r.tiers, 0)
    last_in: dict[str, float] = {}
    for d in r.decisions:
        if d.action == "scale_in" and d.delta < 0:
            last_in[d.tier] = d.t
        elif d.delta > 0 and d.tier in last_in:
            if d.t - last_in[d.tier] <= r.tiers[d.tier].tc.scale_in_hold_s + 1e-9:
                out[d.tier] += 1
            del last_in[d.tier]  # one scale-in undone counts once
    return out


def budget_use(r: SimResult) -> dict[str, float]:
    """Spent / budget for every budget window the replay touched, keyed "tier/window"."""
    return {f"{t}/{w}": round(v["spent_usd"] / v["budget_usd"], 4) if v["budget_usd"] else 0.0
            for t, b in r.budget.items() for w, v in b.items()}


def _extras(o: Any) -> dict[str, Any]:
    """A class's counts shown only when there are any: cancelled, unheard, and degraded (refused
    here and served by a smaller tier, by reason and by target; served here for a larger one)."""
    return {**({"cancelled": o.cancelled} if o.cancelled else {}), **({"unheard": o.unheard} if o.unheard else {}),
            **({"degraded": dict(sorted(o.degraded.items())), "degraded_to": dict(sorted(o.degraded_to.items()))}
               if o.degraded else {}), **({"degraded_in": o.degraded_in} if o.degraded_in else {})}


def summarize(r: SimResult, *, timeline: bool = True) -> dict[str, Any]:
    """The replay as one plain dict (what --json prints): per tier and class, outcomes and
    latencies; per tier, replica-hours, spend and budget windows; goodput; the timeline."""
    sc = r.scenario
    dur = sc.duration_s
    tiers: dict[str, Any] = {}
    total_completed = 0
    committed_completed = 0
    committed_accepted_or_shed = 0
    for name, t in r.tiers.items():
        classes: dict[str, Any] = {}
        useful = 0
        for cls, o in zip(CLASSES, t.outcomes, strict=True):
            if not o.arrived and not o.degraded_in:
                continue
            unfinished = o.accepted - o.completed - o.expired_waiting - o.expired_running - o.cancelled - o.unheard
            classes[cls] = {
                "arrived": o.arrived, "accepted": o.accepted, "completed": o.completed,
                "shed": dict(sorted(o.shed.items())), "expired": o.expired_waiting + o.expired_running,
                "expired_waiting": o.expired_waiting, "expired_running": o.expired_running,
                "preempted": o.preempted,
                "within_objective": o.within_objective,
                "unfinished_at_end": unfinished,
                **_extras(o),
                "wait_s": _p50_p99(o.waits),
                "ttft_s": _p50_p99(o.ttfts),
                "tpot_s": _p50_p99(o.tpots, 4),
            }
            useful += o.useful_tokens
            total_completed += o.completed
            if cls == "committed":
                committed_completed += o.completed
                committed_accepted_or_shed += o.arrived
        rh = {k: round(v / 3600, 3) for k, v in t.replica_s.items()}
        spend = t.spend_usd
        tiers[name] = {
            "classes": classes,
            "replica_hours": round(t.replica_seconds / 3600, 3),
            "replica_hours_by_state": rh,
            "peak_replicas": t.peak_replicas,
            "replicas_at_end": t.alive(),
            "spend_usd": round(spend, 4),
            "token_spend_usd": round(t.token_usd, 4),
            "useful_tokens": useful,
            # What the prefix caches saved: prompt tokens of the calls begun, those their prefills computed.
            "prompt_tokens": t.prompt_tokens, "prefill_tokens": t.prefill_tokens,
            "prefix_cache_hit_rate": round(1 - t.prefill_tokens / t.prompt_tokens, 4) if t.prompt_tokens else 0.0,
            "cost_per_million_useful_tokens_usd": _num(cost_per_useful_million(spend, useful, dur), 4),
            "budget": {w: {**v, "spent_usd": round(v["spent_usd"], 4)} for w, v in r.budget.get(name, {}).items()},
        }
    flapped = flaps(r)
    for name, n in flapped.items():
        tiers[name]["flaps"] = n
    spend = sum(t.spend_usd for t in r.tiers.values())
    useful_all = sum(v["useful_tokens"] for v in tiers.values())
    out: dict[str, Any] = {
        "scenario": sc.name, "policy": r.policy, "seed": r.seed, "start": sc.start.isoformat(),
        "duration_s": dur,
        "goodput_rps": round(total_completed / dur, 4),
        "committed_goodput_rps": round(committed_completed / dur, 4),
        "committed_on_time": committed_completed, "committed_arrived": committed_accepted_or_shed,
        "objectives": objectives.attainment(r),
        "replica_hours": round(sum(t.replica_seconds for t in r.tiers.values()) / 3600, 3),
        "spend_usd": round(spend, 4),
        "cost_per_million_useful_tokens_usd": _num(cost_per_useful_million(spend, useful_all, dur), 4),
        "within_budget": all(w["within"] for b in r.budget.values() for w in b.values()),
        "budget_use": budget_use(r),
        "flaps": flapped,
        "ended_s": round(max(r.ended_s, dur), 3),
        "tiers": tiers,
        "chains": r.chains,
        "chains_by_class": r.chains_by_class, "callers": r.callers,  # callers: `simulator.clients.summary`
        "wall_s": round(r.wall_s, 3),
        "events": r.events,
    }
    if timeline:
        out["timeline"] = [{"at": sc.clock(d.t), "t": round(d.t, 3), "tier": d.tier, "action": d.action,
                            "delta": d.delta, "reason": d.reason, "floor": d.floor, "ceiling": d.ceiling}
                           for d in r.decisions]
    return out


def with_bounds(s: dict[str, Any], served_hours: float, every_call_hours: float) -> dict[str, Any]:
    """`s` (a summary) with its bounds: the served bound (the calls this replay served on time,
    with the floors) and the every-call + floors bound, in replica-hours, and the ratios to
    each. `bound_ratio` is to the served bound: the only one a policy that sheds cannot beat."""
    rh = s["replica_hours"]
    s["bound"] = {"served_replica_hours": round(served_hours, 3),
                  "every_call_replica_hours": round(every_call_hours, 3)}
    s["bound_ratio"] = round(rh / served_hours, 3) if served_hours > 0 else None
    s["bound_ratio_every_call"] = round(rh / every_call_hours, 3) if every_call_hours > 0 else None
    return s


def replicas_at(r: SimResult, tier: str, t: float) -> int | None:
    """Replicas alive (starting + ready + draining) at the last tick at or before `t`."""
    best = None
    for s in r.samples[tier]:
        if s.t > t + 1e-9:
            break
        best = s.starting + s.ready + s.draining
    return best



def committed_missed(r: SimResult) -> int:
    """Committed calls that arrived and did not complete on time (shed, expired or aborted)."""
    return sum(t.outcomes[0].arrived - t.outcomes[0].completed for t in r.tiers.values())


def checks(r: SimResult, bound_hours: float | None = None,
           rows: list[dict[str, Any]] | None = None) -> list[tuple[str, bool, str]]:
    """The scenario's `expect:` block, judged: (name, passed, what was seen).

    `bound_hours`: the clairvoyant served bound (the calls this replay served on time, with
    the floors), for `bound_ratio`;
    `rows`: the compare rows (`--compare`), for `beats_baselines` (skipped without them).
    """
    exp = r.scenario.spec.expect
    out: list[tuple[str, bool, str]] = []
    if "committed_missed" in exp:
        n = committed_missed(r)
        out.append(("committed calls missed", n <= exp["committed_missed"], f"{n} missed"))
    if "flaps" in exp:
        f = flaps(r)
        out.append(("flaps (a scale-out within the hold after a scale-in)", sum(f.values()) <= exp["flaps"],
                    ", ".join(f"{k} {v}" for k, v in f.items())))
    if "bound_ratio" in exp and bound_hours:
        ratio = sum(t.replica_seconds for t in r.tiers.values()) / 3600 / bound_hours
        out.append((f"replica-hours within {exp['bound_ratio']}x the clairvoyant served bound",
                    ratio <= exp["bound_ratio"], f"{ratio:.3f}x of {bound_hours:.2f} replica-hours"))
    if exp.get("beats_baselines") and rows:
        me = next(x for x in rows if x["policy"] == r.policy)
        others = [x for x in rows if x["rank"] is not None and x["policy"] != r.policy]
        # Replica-hours are compared at equal goodput: a baseline that serves fewer calls on time
        # than we do has bought its replica-hours with those calls (it is named, not counted).
        worse = [f"{x['policy']} {x['replica_hours']:.2f} h" for x in others
                 if x["replica_hours"] < me["replica_hours"] and x["goodput_rps"] >= me["goodput_rps"]]
        worse += [f"{x['policy']} committed {x['committed_goodput_rps']:.3f}/s" for x in others
                  if x["committed_goodput_rps"] > me["committed_goodput_rps"] + 1e-9]
        cheaper = [f"{x['policy']} {x['replica_hours']:.2f} h at {x['goodput_rps']:.2f}/s" for x in others
                   if x["replica_hours"] < me["replica_hours"] and x["goodput_rps"] < me["goodput_rps"]]
        seen = f"{me['replica_hours']:.2f} h at {me['goodput_rps']:.2f}/s; " + (
            "; ".join(worse) + " better" if worse else "ahead of all at our goodput")
        if cheaper:
            seen += " (fewer replica-hours, serving less: " + "; ".join(cheaper) + ")"
        out.append(("no more replica-hours than any baseline at our goodput, no less committed goodput", not worse,
                    seen))
    if "committed_chains_failed" in exp:
        c = r.chains_by_class.get("committed", {})
        bad = c.get("timed_out", 0) + c.get("shed", 0)
        out.append(("committed chains timed out or shed", bad <= exp["committed_chains_failed"],
                    f"{c.get('timed_out', 0)} timed out, {c.get('shed', 0)} shed of {c.get('started', 0)}"))
    for tier, cls in (exp.get("shed_by_budget") or {}).items():
        o = r.tiers[tier].outcomes[CLASSES.index(cls)]
        n = o.shed.get("budget_exhausted", 0) + o.degraded.get("budget_exhausted", 0)  # refused there either way
        committed = r.tiers[tier].outcomes[0].shed.get("budget_exhausted", 0)
        out.append((f"{tier} {cls} shed (or degraded) with budget_exhausted, committed not", n > 0 and committed == 0,
                    f"{n} {cls} refused by budget ({o.degraded.get('budget_exhausted', 0)} of them degraded), "
                    f"{committed} committed"))
    if exp.get("within_budget"):
        over = [f"{t}/{w}: ${v['spent_usd']:.2f} > ${v['budget_usd']:.2f}" for t, b in r.budget.items()
                for w, v in b.items() if not v["within"]]
        out.append(("spend within every budget window (one tick of burn at most over)", not over,
                    "; ".join(over) or "all within"))
    for clock, floors in (exp.get("replicas_at") or {}).items():
        t = r.scenario.at(clock)
        seen = {tier: replicas_at(r, tier, t) for tier in floors}
        out.append((f"replicas at {clock}", all(seen[k] == v for k, v in floors.items()),
                    ", ".join(f"{k} {seen[k]} (want {v})" for k, v in floors.items())))
    return out



def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths,
                                                                                          strict=True)))
    body = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]
    return "\n".join([line, "-" * len(line), *body])


def render_summary(s: dict[str, Any], *, timeline_limit: int | None = 200) -> str:
    """The summary for a terminal: the timeline of decisions, then the outcome tables."""
    out = [f"scenario {s['scenario']} under policy {s['policy']} (seed {s['seed']}, "
           f"{s['duration_s'] / 3600:.2f} h simulated in {s['wall_s']:.1f} s, {s['events']} events)", ""]
    if "timeline" in s and timeline_limit != 0:
        tl = [d for d in s["timeline"] if d["action"] != "hold" or d["delta"]]
        holds = [d for d in s["timeline"] if d["action"] == "hold" and not d["delta"]]
        shown = tl if timeline_limit is None else tl[:timeline_limit]
        out.append(f"timeline of decisions ({len(tl)} actions; {len(holds)} changes of hold reason not shown)")
        out += [f"  {d['at']}  {d['tier']:<10} {d['reason']}" for d in shown]
        if len(shown) < len(tl):
            out.append(f"  ... {len(tl) - len(shown)} more (--json has them all)")
        out.append("")
    rows = []
    for tier, t in s["tiers"].items():
        for cls, c in t["classes"].items():
            shed = ", ".join(f"{k} {v}" for k, v in c["shed"].items()) or "-"
            moved = ", ".join(f"{k} {v}" for k, v in c.get("degraded_to", {}).items()) or "-"
            rows.append([f"{tier}/{cls}", str(c["arrived"]), str(c["completed"]), shed, moved, str(c["expired"]),
                         _f(c["wait_s"]["p50"]), _f(c["wait_s"]["p99"]), _f(c["ttft_s"]["p50"]),
                         _f(c["ttft_s"]["p99"]), _f(c["tpot_s"]["p50"], 4), _f(c["tpot_s"]["p99"], 4)])
    out.append(_table(["tier/class", "arrived", "completed", "shed (reason n)", "degraded (to n)", "expired",
                       "wait p50", "wait p99", "ttft p50", "ttft p99", "tpot p50", "tpot p99"], rows))
    preempted = [f"{tier}/{cls} {c['preempted']}" for tier, t in s["tiers"].items()
                 for cls, c in t["classes"].items() if c.get("preempted")]
    if preempted:
        out.append("preempted (went back to the line for a higher class): " + ", ".join(preempted))
    out.append("")
    rows = []
    for tier, t in s["tiers"].items():
        b = "; ".join(f"{w} ${v['spent_usd']:.2f}/${v['budget_usd']:.2f}{'' if v['within'] else ' OVER'}"
                      for w, v in t["budget"].items()) or "-"
        rows.append([tier, _f(t["replica_hours"]), str(t["peak_replicas"]), str(t["replicas_at_end"]),
                     str(t.get("flaps", 0)), _f(t["spend_usd"]), _f(t["cost_per_million_useful_tokens_usd"]),
                     f"{t['prefix_cache_hit_rate']:.0%}", b])
    out.append(_table(["tier", "replica-h", "peak", "at end", "flaps", "spend $", "$/M useful tok",
                       "cache hit", "budget (spent/budget)"], rows))
    out.append("")
    rows = [[name, str(c["started"]), str(c["completed"]), str(c["timed_out"]), str(c["shed"])]
            for name, c in s["chains"].items()]
    if rows:
        out.append(_table(["chain", "started", "completed", "timed out", "shed"], rows))
        out.append("")
    if s.get("objectives"):
        out.append(objectives.render(s["objectives"]))
    if s.get("callers"):
        out += [render_callers(s["callers"]), ""]
    out.append(f"goodput {s['goodput_rps']:.2f} req/s (committed {s['committed_goodput_rps']:.2f}); "
               f"replica-hours {s['replica_hours']:.2f}; spend ${s['spend_usd']:.2f} "
               f"({'within' if s['within_budget'] else 'OVER'} budget); "
               f"${_f(s['cost_per_million_useful_tokens_usd'])} per million useful tokens; "
               f"flaps {sum(s['flaps'].values())}"
               + (f"; {s['bound_ratio']:.2f}x the clairvoyant served bound" if s.get("bound_ratio") else "")
               + (f" ({s['bound_ratio_every_call']:.2f}x the every-call + floors bound)"
                  if s.get("bound_ratio_every_call") else ""))
    return "\n".join(out)


def render_checks(results: list[tuple[str, bool, str]]) -> str:
    return "\n".join(f"  [{'pass' if ok else 'FAIL'}] {name}: {seen}" for name, ok, seen in results)


def compare_rows(summaries: list[dict[str, Any]], bound: dict[str, TierBound] | None,
                 bound_all: dict[str, TierBound] | None = None,
                 bound_floors: dict[str, TierBound] | None = None) -> list[dict[str, Any]]:
    """One row per policy, ranked by goodput (high first), then replica-hours and spend (low first).

    `bound_ratio` is a summary's own (`with_bounds`: to the calls it served on time), else
    to the "every call + floors" bound; `bound_ratio_every_call` always to the latter.
    """
    rows = []
    # The "every call + floors" bound: replica-hours below which no schedule serves every call
    # on time while keeping the floors every policy here keeps.
    ref = sum(x.replica_seconds for x in bound_floors.values()) / 3600 if bound_floors else 0.0
    for s in summaries:
        cc = s["chains_by_class"].get("committed", {})
        rows.append({
            "policy": s["policy"], "goodput_rps": s["goodput_rps"], "committed_goodput_rps": s["committed_goodput_rps"],
            "committed_missed": s["committed_arrived"] - s["committed_on_time"],
            "committed_chains_failed": cc.get("timed_out", 0) + cc.get("shed", 0),
            "replica_hours": s["replica_hours"], "spend_usd": s["spend_usd"],
            "cost_per_million_useful_tokens_usd": s["cost_per_million_useful_tokens_usd"],
            "within_budget": s["within_budget"],
            "flaps": sum(s["flaps"].values()), "flaps_by_tier": s["flaps"],
            "bound_ratio": s.get("bound_ratio", round(s["replica_hours"] / ref, 3) if ref > 0 else None),
            "bound_ratio_every_call": round(s["replica_hours"] / ref, 3) if ref > 0 else None,
            "served_bound_replica_hours": (s.get("bound") or {}).get("served_replica_hours"),
            "budget_use": s["budget_use"],
            "objectives": objectives.shares(s.get("objectives") or {}),
            "callers": s.get("callers"),
        })
    rows.sort(key=lambda r: (-r["goodput_rps"], r["replica_hours"], r["spend_usd"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    for key in ("replica_hours", "spend_usd"):  # the cost ranks: cheapest first
        for i, r in enumerate(sorted(rows, key=lambda r: r[key]), 1):
            r[f"rank_{key}"] = i
    for label, b in (("clairvoyant: committed (bound)", bound), ("clairvoyant: every call", bound_all),
                     ("clairvoyant: every call + floors", bound_floors)):
        if b is not None:
            rows.append({"policy": label, "goodput_rps": None, "committed_goodput_rps": None,
                         "committed_missed": 0, "committed_chains_failed": 0,
                         "replica_hours": round(sum(x.replica_seconds for x in b.values()) / 3600, 3),
                         "spend_usd": round(sum(x.spend_usd for x in b.values()), 4),
                         "cost_per_million_useful_tokens_usd": None, "within_budget": None, "rank": None,
                         "flaps": None, "flaps_by_tier": None, "budget_use": None,
                         "bound_ratio": None,  # a bound has no served calls of its own
                         "bound_ratio_every_call": (round(sum(x.replica_seconds for x in b.values()) / 3600 / ref, 3)
                                                    if ref > 0 else None),
                         "served_bound_replica_hours": None, "objectives": None, "callers": None,
                         "rank_replica_hours": None, "rank_spend_usd": None})
    return rows


def render_compare(rows: list[dict[str, Any]]) -> str:
    def rk(r: dict[str, Any], key: str) -> str:
        return f" (#{r[key]})" if r.get(key) else ""

    table = [[r["policy"], str(r["rank"] or "-"), _f(r["goodput_rps"]), _f(r["committed_goodput_rps"]),
              str(r["committed_missed"]), str(r["committed_chains_failed"]),
              _f(r["replica_hours"]) + rk(r, "rank_replica_hours"), _f(r["spend_usd"]) + rk(r, "rank_spend_usd"),
              _f(r["cost_per_million_useful_tokens_usd"]),
              "-" if r["within_budget"] is None else ("yes" if r["within_budget"] else "NO"),
              "-" if r["flaps"] is None else str(r["flaps"]), _f(r.get("served_bound_replica_hours")),
              _f(r["bound_ratio"]), _f(r.get("bound_ratio_every_call")),
              _use(r["budget_use"]), objectives.cell(r.get("objectives"))] for r in rows]
    out = _table(["policy", "#", "goodput/s", "committed/s", "committed missed", "committed chains failed",
                  "replica-h (#)", "spend $ (#)", "$/M useful", "in budget", "flaps", "served bound h",
                  "x served bound", "x every call", "budget use (highest)", "within objective %"], table)
    return out + callers_compare(rows)


def _use(use: dict[str, float] | None) -> str:
    if not use:
        return "-"
    k = max(use, key=use.__getitem__)
    return f"{use[k]:.0%} {k}"
