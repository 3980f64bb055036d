"""`--plot FILE.png`: demand, line, seconds-to-drain, replicas by state and spend over time, per tier."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulator.results import SimResult

PANELS = ("demand (req/s)", "line (waiting)", "seconds-to-drain", "replicas", "spend ($)")


def plot(result: SimResult, path: str | Path, others: list[SimResult] | None = None) -> Path:
    """Draw one row per tier (five panels); with `others`, a last row compares the policies'
    replicas and spend over time."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    sc = result.scenario
    tiers = list(result.tiers)
    rows = len(tiers) + (1 if others else 0)
    fig, axes = plt.subplots(rows, len(PANELS), figsize=(4.2 * len(PANELS), 2.6 * rows), squeeze=False,
                             sharex=True)

    def hours(ts: list[float]) -> list[float]:
        return [(sc.start.hour * 3600 + sc.start.minute * 60 + t) / 3600 for t in ts]

    for i, tier in enumerate(tiers):
        _tier_row(axes[i], result, tier, hours, first=i == 0)
    for j, title in enumerate(PANELS):
        axes[0][j].set_title(title, fontsize=9)
    if others:
        _compare_row(axes[rows - 1], [result, *others], tiers, hours)
    _clock_axes(axes)
    fig.suptitle(f"{sc.name}: policy {result.policy}", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


Hours = Callable[[list[float]], list[float]]


def _tier_row(row: Any, result: SimResult, tier: str, hours: Hours, *, first: bool) -> None:
    """One tier's five panels: demand, line, seconds-to-drain, replicas by state, spend."""
    samples = result.samples[tier]
    x = hours([p.t for p in samples])
    row[0].plot(x, [p.offered for p in samples], lw=0.8, color="tab:blue", label="offered")
    row[0].plot(x, [p.arrivals for p in samples], lw=0.6, color="tab:cyan", ls="--", label="admitted")
    row[1].plot(x, [p.waiting for p in samples], lw=0.8, color="tab:orange")
    threshold = result.tiers[tier].tc.drain_threshold_s
    drain = [p.drain_s if math.isfinite(p.drain_s) else float("nan") for p in samples]
    row[2].plot(x, drain, lw=0.8, color="tab:red")
    row[2].axhline(threshold, ls="--", lw=0.8, color="grey")
    row[3].stackplot(x, [p.ready for p in samples], [p.starting for p in samples], [p.draining for p in samples],
                     labels=["ready", "starting", "draining"], colors=["tab:green", "gold", "tab:purple"],
                     step="post")
    row[4].plot(x, [p.spend_usd for p in samples], lw=0.9, color="black", label="since start")
    _budget_windows(row[4], result, tier, hours, x)
    row[0].set_ylabel(tier, fontsize=10, fontweight="bold")
    if first:
        row[3].legend(loc="upper right", fontsize=7)
        row[0].legend(loc="upper right", fontsize=7)


def _budget_windows(ax: Any, result: SimResult, tier: str, hours: Hours, x: list[float]) -> None:
    """Each budget window's spend since it opened, against its budget."""
    samples = result.samples[tier]
    for name, v in result.budget.get(tier, {}).items():
        if v["from_before_replay"]:
            continue  # a window opened before the replay (the day): its spend is not all here
        opened = result.scenario.at(v["start"])
        base = next((p.spend_usd for p in samples if p.t >= opened), 0.0)
        inside = [p for p in samples if p.t >= opened]
        ax.plot(hours([p.t for p in inside]), [p.spend_usd - base for p in inside], lw=0.9,
                color="tab:red", label=f"{name} window")
        ax.axhline(v["budget_usd"], ls=":", lw=0.8, color="tab:red")
        ax.annotate(f"{name} budget ${v['budget_usd']:g}", (x[0] if x else 0, v["budget_usd"]),
                    fontsize=7, color="tab:red", va="bottom")
        ax.legend(loc="center right", fontsize=7)


def _compare_row(row: Any, results: list[SimResult], tiers: list[str], hours: Hours) -> None:
    """The policies side by side: replicas and spend over all tiers, and a table of totals."""
    for res in results:
        x = hours([p.t for p in res.samples[tiers[0]]])
        total = [sum(res.samples[t][k].starting + res.samples[t][k].ready + res.samples[t][k].draining
                     for t in tiers) for k in range(len(x))]
        spend = [sum(res.samples[t][k].spend_usd for t in tiers) for k in range(len(x))]
        row[3].plot(x, total, lw=0.9, label=res.policy)
        row[4].plot(x, spend, lw=0.9, label=res.policy)
    row[3].set_title("all tiers: replicas by policy", fontsize=9)
    row[4].set_title("all tiers: spend by policy", fontsize=9)
    row[3].legend(fontsize=7)
    for j in range(3):
        row[j].axis("off")
    lines = ["policy      replica-h   spend $   completed"]
    for res in results:
        replica_h = sum(t.replica_seconds for t in res.tiers.values()) / 3600
        usd = sum(t.spend_usd for t in res.tiers.values())
        done = sum(o.completed for t in res.tiers.values() for o in t.outcomes)
        lines.append(f"{res.policy:<10}{replica_h:>11.2f}{usd:>10.2f}{done:>12d}")
    row[0].text(0.0, 1.0, "\n".join(lines), va="top", family="monospace", fontsize=8,
                transform=row[0].transAxes)


def _clock_axes(axes: Any) -> None:
    """Times of day on the bottom row's x axes, small tick labels everywhere."""
    from matplotlib.ticker import FuncFormatter

    clock = FuncFormatter(lambda h, _: f"{int(h) % 24:02d}:{round(h % 1 * 60) % 60:02d}")
    for ax in axes[-1]:
        ax.set_xlabel("time of day", fontsize=8)
        ax.xaxis.set_major_formatter(clock)
    for row in axes:
        for ax in row:
            ax.tick_params(labelsize=7)
