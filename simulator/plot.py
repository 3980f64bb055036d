"""`--plot FILE.png`: demand, line, seconds-to-drain, replicas by state and spend over time, per tier."""

from __future__ import annotations

import math
from pathlib import Path

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
        s = result.samples[tier]
        x = hours([p.t for p in s])
        axes[i][0].plot(x, [p.offered for p in s], lw=0.8, color="tab:blue", label="offered")
        axes[i][0].plot(x, [p.arrivals for p in s], lw=0.6, color="tab:cyan", ls="--", label="admitted")
        axes[i][1].plot(x, [p.waiting for p in s], lw=0.8, color="tab:orange")
        thr = result.tiers[tier].tc.drain_threshold_s
        drain = [p.drain_s if math.isfinite(p.drain_s) else float("nan") for p in s]
        axes[i][2].plot(x, drain, lw=0.8, color="tab:red")
        axes[i][2].axhline(thr, ls="--", lw=0.8, color="grey")
        axes[i][3].stackplot(x, [p.ready for p in s], [p.starting for p in s], [p.draining for p in s],
                             labels=["ready", "starting", "draining"], colors=["tab:green", "gold", "tab:purple"],
                             step="post")
        axes[i][4].plot(x, [p.spend_usd for p in s], lw=0.9, color="black", label="since start")
        for name, v in result.budget.get(tier, {}).items():
            if v["from_before_replay"]:
                continue  # a window opened before the replay (the day): its spend is not all here
            s0 = sc.at(v["start"])
            base = next((p.spend_usd for p in s if p.t >= s0), 0.0)
            inside = [p for p in s if p.t >= s0]
            axes[i][4].plot(hours([p.t for p in inside]), [p.spend_usd - base for p in inside], lw=0.9,
                            color="tab:red", label=f"{name} window")
            axes[i][4].axhline(v["budget_usd"], ls=":", lw=0.8, color="tab:red")
            axes[i][4].annotate(f"{name} budget ${v['budget_usd']:g}", (x[0] if x else 0, v["budget_usd"]),
                                fontsize=7, color="tab:red", va="bottom")
            axes[i][4].legend(loc="center right", fontsize=7)
        axes[i][0].set_ylabel(tier, fontsize=10, fontweight="bold")
        if i == 0:
            axes[i][3].legend(loc="upper right", fontsize=7)
            axes[i][0].legend(loc="upper right", fontsize=7)
    for j, title in enumerate(PANELS):
        axes[0][j].set_title(title, fontsize=9)
    if others:
        r = rows - 1
        for res in [result, *others]:
            x = hours([p.t for p in res.samples[tiers[0]]])
            total = [sum(res.samples[t][k].starting + res.samples[t][k].ready + res.samples[t][k].draining
                         for t in tiers) for k in range(len(x))]
            spend = [sum(res.samples[t][k].spend_usd for t in tiers) for k in range(len(x))]
            axes[r][3].plot(x, total, lw=0.9, label=res.policy)
            axes[r][4].plot(x, spend, lw=0.9, label=res.policy)
        axes[r][3].set_title("all tiers: replicas by policy", fontsize=9)
        axes[r][4].set_title("all tiers: spend by policy", fontsize=9)
        axes[r][3].legend(fontsize=7)
        for j in range(3):
            axes[r][j].axis("off")
        lines = ["policy      replica-h   spend $   completed"]
        for res in [result, *others]:
            rh = sum(t.replica_seconds for t in res.tiers.values()) / 3600
            usd = sum(t.spend_usd for t in res.tiers.values())
            done = sum(o.completed for t in res.tiers.values() for o in t.outcomes)
            lines.append(f"{res.policy:<10}{rh:>11.2f}{usd:>10.2f}{done:>12d}")
        axes[r][0].text(0.0, 1.0, "\n".join(lines), va="top", family="monospace", fontsize=8,
                        transform=axes[r][0].transAxes)
    from matplotlib.ticker import FuncFormatter

    clock = FuncFormatter(lambda h, _: f"{int(h) % 24:02d}:{round(h % 1 * 60) % 60:02d}")
    for ax in axes[-1]:
        ax.set_xlabel("time of day", fontsize=8)
        ax.xaxis.set_major_formatter(clock)
    for row in axes:
        for ax in row:
            ax.tick_params(labelsize=7)
    fig.suptitle(f"{sc.name}: policy {result.policy}", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
