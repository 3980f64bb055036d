"""The budget governor's math: pure functions of spend, burn and `now`. No I/O.

The lesson on capacity governance (docs/architecture.md, "What the policy keeps from its
sources"): "attach a budget to each endpoint and let it bound
the autoscaler's ceiling. When an endpoint's projected spend for the day
crosses its budget, the autoscaler stops adding capacity and the fleet sheds
instead." The autoscaling exercise gives the unit: cost per million
*useful* tokens, C = 1e6 * H / (3600 * r).

The pieces, each taking `now` (epoch seconds) as input so the live governor and
the simulator agree:

- windows: the daily window (from `reset_at` in `timezone`) and any named
  windows (a cron start plus a duration) active at `now`;
- `least_spend`: spent so far + the floor for the rest of the window + each
  replica above the floor for one hold (a burst's replicas are scaled in after
  it, at the soonest after one hold);
- `burst_ceiling`: the most replicas whose least spend keeps the window within
  the budget (`budget_ceiling` is the older burn-to-the-end rule);
- `judge`: all of that for one tier, with the reason it decided what it did.

Exhausted means the fleet *as it runs now* cannot be afforded to the end of a
window (projected spend >= budget) and shedding can lower the spend
(`shedding_saves`: a per-token price, or replicas above the floor). Then classes
below committed are shed with `budget_exhausted`, which lets the line empty and
the scaler step down: the burn falls, and with it the projection. Work on
replicas already paid for is not shed by budget: within budget (decision 0013),
nor on the floor of a tier billed by the replica-second, which bills to the
window's end whether it serves or idles (decision 0083).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo

from fleet.config import Budget, TierConfig
from fleet.policy.capacity import cost_per_million_tokens
from fleet.policy.cron import next_after, prev_before

DAILY = "daily"
_EPS = 1e-9  # float slack so that exactly-affordable replicas are not floored away


# --- Windows --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """One instance of a budget window: [start, end) in epoch seconds."""

    name: str
    start: float
    end: float
    usd: float

    def rest_s(self, now: float) -> float:
        return max(0.0, self.end - now)


def parse_reset(reset_at: str) -> time:
    """`HH:MM` (24 h) -> time; ValueError names what is wrong."""
    try:
        hh, mm = reset_at.strip().split(":")
        return time(int(hh), int(mm))
    except (ValueError, TypeError):
        raise ValueError(f"reset_at must be HH:MM (24 h), got {reset_at!r}") from None


def budget_day(budget: Budget, now: float) -> tuple[float, float]:
    """The budget day around `now`: from the last reset to the next (epoch seconds).

    Built in the budget's time zone from calendar dates, so a day across a DST
    change is 23 or 25 hours long, as the operator's wall clock says. Spend
    "today" is reported over this day even for a tier without a daily budget.
    """
    tz = ZoneInfo(budget.timezone)
    day = datetime.fromtimestamp(now, tz).date()
    before, today, after = _resets_around(budget.timezone, budget.reset_at, day)
    return (today, after) if today <= now else (before, today)


@lru_cache(maxsize=64)
def _resets_around(timezone: str, reset_at: str, day: date) -> tuple[float, float, float]:
    """The resets of the day before `day`, of `day` and of the day after (epoch seconds). Pure in
    its arguments, so kept: the governor asks `budget_day` at every tick of every tier."""
    tz, at = ZoneInfo(timezone), parse_reset(reset_at)

    def reset(d: int) -> float:
        return datetime.combine(day + timedelta(days=d), at, tzinfo=tz).timestamp()

    return reset(-1), reset(0), reset(1)


def daily_window(budget: Budget, now: float) -> Window | None:
    """The daily budget's window at `now`; None without a daily budget."""
    if budget.daily_usd is None:
        return None
    start, end = budget_day(budget, now)
    return Window(DAILY, start, end, budget.daily_usd)


def named_windows(budget: Budget, now: float) -> list[Window]:
    """The named windows active at `now` (each from its latest cron start)."""
    tz = ZoneInfo(budget.timezone)
    # croniter's get_prev is strictly before its base; nudge the base so a
    # window that starts exactly now counts as started.
    base = datetime.fromtimestamp(now, tz) + timedelta(microseconds=1)
    out = []
    for w in budget.windows:
        start = prev_before(w.cron, base)
        if start <= now < start + w.duration_s:
            out.append(Window(w.name, start, start + w.duration_s, w.usd))
    return out


def active_windows(budget: Budget, now: float) -> list[Window]:
    """Every budget window that constrains spend at `now`: daily first."""
    daily = daily_window(budget, now)
    return ([daily] if daily else []) + named_windows(budget, now)


def upcoming_windows(budget: Budget, now: float, lead_s: float) -> list[Window]:
    """The window instances that open after `now` and within `lead_s` (the next
    budget day included): a replica running when one opens bills against it, so
    the ceiling must step the tier down *before* it opens, not after."""
    if lead_s <= 0:
        return []
    out = []
    if budget.daily_usd is not None:
        _, reset = budget_day(budget, now)
        if reset - now <= lead_s:
            _, next_reset = budget_day(budget, reset)
            out.append(Window(DAILY, reset, next_reset, budget.daily_usd))
    tz = ZoneInfo(budget.timezone)
    base = datetime.fromtimestamp(now, tz)
    for w in budget.windows:
        # Every instance in the lead has the same duration and nothing spent: the first stands for all.
        start = next_after(w.cron, base)
        if now < start <= now + lead_s:
            out.append(Window(w.name, start, start + w.duration_s, w.usd))
    return out


def budget_lead_s(tc: TierConfig, startup_s: float) -> float:
    """How far ahead a window that is about to open bounds the ceiling: long enough
    for the scale-in hold to pass and a replica to be replaced by a start-up."""
    return max(0.0, startup_s) + tc.scale_in_hold_s


# --- Cost -----------------------------------------------------------------------


def tier_has_budget(tc: TierConfig) -> bool:
    """Whether a budget can bound the tier's replicas: they cost something, and a window caps it."""
    return tc.hourly_usd > 0 and (tc.budget.daily_usd is not None or bool(tc.budget.windows))


TOKEN_BURN_MINUTES = 1  # full minutes behind the current one over which the token burn is measured


def token_burn_since(now: float) -> float:
    """Where the token burn's window starts: the last full minute before the current one
    (the ledger keeps spend to the minute)."""
    return (now // 60 - TOKEN_BURN_MINUTES) * 60


def token_burn_usd_per_s(token_usd_in_window: float, now: float) -> float:
    """Per-token spend per second: what tokens cost since `token_burn_since(now)`, over that time."""
    return max(0.0, token_usd_in_window) / max(1.0, now - token_burn_since(now))


def replica_usd_per_s(tc: TierConfig) -> float:
    """What one replica of the tier burns per second, in any state (a starting
    replica holds its GPUs too: the cold-start tax is a real cost)."""
    return tc.hourly_usd / 3600.0


def cost_per_useful_million(spent_usd: float, useful_tokens: int, seconds: float) -> float:
    """Dollars per million useful tokens over a period, by the chapter's formula:
    H = spend rate per hour, r = useful tokens per second. Infinite with none."""
    if seconds <= 0 or useful_tokens <= 0:
        return math.inf
    return cost_per_million_tokens(spent_usd * 3600.0 / seconds, useful_tokens / seconds)


# --- Projection and ceiling -----------------------------------------------------


def projected_spend(spent_usd: float, burn_usd_per_s: float, now: float, window_end: float) -> float:
    """Spent so far plus the current burn rate over the rest of the window."""
    return spent_usd + max(0.0, burn_usd_per_s) * max(0.0, window_end - now)


def least_spend(spent_usd: float, replicas: int, floor: int, rest_s: float, hold_s: float,
                replica_usd_per_s: float, other_burn_usd_per_s: float = 0.0) -> float:
    """What the window will cost at least, with `replicas` running now: spent so far, the
    floor for the rest of the window, and each extra replica for its least hold.

    A burst's extra replicas do not run to the window's end: once the demand falls they
    leave after one `scale_in_hold_s` at the soonest (`decide_tier` steps down to the
    highest need the hold saw, the floor when the burst is over). Projecting today's
    burn to the window's end would leave the budget idle;
    this projection lets a burst spend it. If the burst goes on, spend catches up with
    the projection every tick and the ceiling falls; above it the tier steps down at once
    (`decide_tier`), so the window overspends by no more than a tick's burn and the drains.
    """
    rest = max(0.0, rest_s)
    base = max(0, floor)
    extra = max(0, replicas - base)
    hold = max(0.0, hold_s)
    extra_s = extra * min(rest, hold)
    return (spent_usd + max(0.0, other_burn_usd_per_s) * rest
            + replica_usd_per_s * (min(replicas, base) * rest + extra_s))


def burst_ceiling(budget_usd: float, spent_usd: float, floor: int, rest_s: float, hold_s: float,
                  replica_usd_per_s: float, other_burn_usd_per_s: float = 0.0, most: int = 10_000) -> int | None:
    """The most replicas whose least spend (`least_spend`) keeps the window within its budget;
    when even the floor does not fit, what the old projection allows (below the floor).
    None when replicas cost nothing or the window is over."""
    rest = max(0.0, rest_s)
    if replica_usd_per_s <= 0 or rest <= 0:
        return None
    if least_spend(spent_usd, floor, floor, rest, hold_s, replica_usd_per_s, other_burn_usd_per_s) > budget_usd + _EPS:
        left = budget_usd - spent_usd - max(0.0, other_burn_usd_per_s) * rest
        return max(0, math.floor(left / (replica_usd_per_s * rest) + _EPS))
    n = max(0, floor)
    # Each extra replica adds min(rest, hold) seconds: as many as the budget left pays for.
    cost = least_spend(spent_usd, n, floor, rest, hold_s, replica_usd_per_s, other_burn_usd_per_s)
    each = replica_usd_per_s * min(rest, max(0.0, hold_s))
    if each <= 0:
        return None  # extra replicas cost nothing in this window: it does not bound them
    return min(most, n + max(0, math.floor((budget_usd - cost) / each + _EPS)))


def budget_ceiling(budget_usd: float, spent_usd: float, now: float, window_end: float,
                   replica_usd_per_s: float, other_burn_usd_per_s: float = 0.0) -> int | None:
    """The most replicas whose burn keeps projected spend within the budget.

    None when replicas cost nothing or the window is over: the budget does not
    bound the count. Never negative.
    """
    rest = max(0.0, window_end - now)
    if replica_usd_per_s <= 0 or rest <= 0:
        return None
    left = budget_usd - spent_usd - max(0.0, other_burn_usd_per_s) * rest
    return max(0, math.floor(left / (replica_usd_per_s * rest) + _EPS))


def replica_cost_usd_per_s(replica_usd_per_s: float, token_burn_usd_per_s: float,
                           replicas: int) -> tuple[float, float]:
    """What one replica costs per second at the present load, and the burn left outside the
    replicas, as `least_spend` and `burst_ceiling` take them.

    Tokens are paid for what the replicas serve: a burst's extra replicas burn tokens only
    while they run, as they burn their hourly price. Projecting the whole present token
    burn to the window's end counted a six-replica planner's tokens for an hour and a half
    after its burst: the ceiling fell to nothing, the tier stepped down to its floor, the
    burn fell, the ceiling came back and the tier scaled out again (a flap each time). So
    each billing replica carries its share of the token burn. A tier billed by tokens
    alone (no hourly price) has no replica cost to bound: its token burn stays outside the
    replicas and its budget acts by shedding.
    """
    token = max(0.0, token_burn_usd_per_s)
    if replica_usd_per_s <= 0 or replicas <= 0:
        return replica_usd_per_s, token
    return replica_usd_per_s + token / replicas, 0.0


# --- The tier's judgement ------------------------------------------------------


def shedding_saves(tc: TierConfig, replicas: int) -> bool:
    """Whether refusing a call by budget can lower what the tier spends (decision 0083).

    Shedding spares two kinds of spend: the per-token charge of the call itself, and the
    replica-seconds above the floor that the line would otherwise keep (shed, the line empties
    and the scaler steps down). Neither exists on a tier billed by the replica-second alone
    while it runs no more than its warm floor: the scaler keeps the floor whatever the budget
    says, so those replicas bill to the window's end whether they serve or idle, and a call
    they serve costs nothing extra. A floor of zero keeps nothing, so there every replica is
    one the budget pays for by choice. A tier with no price at all has nothing shedding could
    save either, but there the budget can only be an operator's deliberate switch (a $0 budget
    to close a tier's lower classes): it keeps the projection's word.
    """
    if tc.hourly_usd <= 0 or (tc.usd_per_million_tokens or 0.0) > 0:
        return True
    return tc.warm_floor <= 0 or replicas > tc.warm_floor


@dataclass(frozen=True, slots=True)
class BudgetObservation:
    """What the governor saw for one tier at `now`."""

    now: float
    replicas: int  # billing now: starting + ready + draining
    spent_usd: dict[str, float] = field(default_factory=dict)  # window name -> spent in its current instance
    token_burn_usd_per_s: float = 0.0  # recent per-token spend rate (tiers with a per-token price)


@dataclass(frozen=True, slots=True)
class WindowView:
    name: str
    start: float
    end: float
    budget_usd: float
    spent_usd: float
    projected_usd: float
    ceiling: int | None  # None: this window does not bound replicas
    exhausted: bool


@dataclass(frozen=True, slots=True)
class BudgetView:
    """A tier's budget judgement.

    `ceiling` is what the budget alone allows (the tightest active window),
    not clamped to max_replicas, so the scaler can tell which limit binds;
    None when no window bounds the replica count.
    """

    exhausted: bool
    window: str | None  # the binding window: the exhausted one, else the tightest
    retry_at: float | None  # when shedding by budget can end: the exhausted windows' latest end
    spent_usd: float
    projected_usd: float
    budget_usd: float | None
    ceiling: int | None
    capped: bool  # the budget is tighter than max_replicas
    burn_usd_per_s: float
    reason: str
    windows: tuple[WindowView, ...] = ()
    upcoming: tuple[WindowView, ...] = ()  # windows opening within the lead: they bound the ceiling only


def judge(tc: TierConfig, obs: BudgetObservation, lead_s: float = 0.0) -> BudgetView:
    """Exhausted?, the ceiling the budget allows, and why. Pure.

    `lead_s` (see `budget_lead_s`): windows opening within it bound the ceiling
    already (nothing spent, their whole duration ahead), so the tier is back
    under it when they open. They do not make the tier exhausted: nothing is
    shed by budget before a window opens.
    """
    per_replica = replica_usd_per_s(tc)
    burn = obs.replicas * per_replica + max(0.0, obs.token_burn_usd_per_s)
    cost, other = replica_cost_usd_per_s(per_replica, obs.token_burn_usd_per_s, obs.replicas)
    views = []
    floor, hold = tc.warm_floor, tc.scale_in_hold_s
    for w in active_windows(tc.budget, obs.now):
        spent = obs.spent_usd.get(w.name, 0.0)
        rest = w.rest_s(obs.now)
        projected = least_spend(spent, obs.replicas, floor, rest, hold, cost, other)
        ceiling = burst_ceiling(w.usd, spent, floor, rest, hold, cost, other)
        views.append(WindowView(w.name, w.start, w.end, w.usd, spent, projected, ceiling,
                                exhausted=projected >= w.usd))
    soon = tuple(
        WindowView(w.name, w.start, w.end, w.usd, 0.0,
                   least_spend(0.0, obs.replicas, floor, w.end - w.start, hold, cost, other),
                   burst_ceiling(w.usd, 0.0, floor, w.end - w.start, hold, cost, other),
                   exhausted=False)
        for w in upcoming_windows(tc.budget, obs.now, lead_s))
    if not views and not soon:
        return BudgetView(False, None, None, 0.0, 0.0, None, None, False, burn, "no budget window is active", ())
    bounded = [v.ceiling for v in (*views, *soon) if v.ceiling is not None]
    ceiling = min(bounded) if bounded else None
    capped = ceiling is not None and ceiling < tc.max_replicas
    spent_out = [v for v in views if v.exhausted]
    if spent_out and not shedding_saves(tc, obs.replicas):
        bind = max(spent_out, key=lambda v: v.end)
        reason = (f"projected spend ${bind.projected_usd:.2f} reaches the {bind.name} budget ${bind.budget_usd:.2f}, "
                  f"but the tier runs only its floor ({floor}), billed by the replica-second: "
                  f"a call shed would save nothing")
        return BudgetView(False, bind.name, None, bind.spent_usd, bind.projected_usd, bind.budget_usd,
                          ceiling, capped, burn, reason, tuple(views), soon)
    if spent_out:
        bind = max(spent_out, key=lambda v: v.end)
        reason = (f"projected spend ${bind.projected_usd:.2f} reaches the {bind.name} budget "
                  f"${bind.budget_usd:.2f} at the current burn of ${burn * 3600:.2f}/h")
        return BudgetView(True, bind.name, bind.end, bind.spent_usd, bind.projected_usd, bind.budget_usd,
                          ceiling, capped, burn, reason, tuple(views), soon)
    # Not exhausted: report the window with the least headroom (an active one on a tie).
    bind = min((*views, *soon), key=lambda v: (v.ceiling if v.ceiling is not None else math.inf,
                                               v.budget_usd - v.projected_usd))
    if bind in soon and ceiling is not None and ceiling < min((v.ceiling for v in views if v.ceiling is not None),
                                                              default=math.inf):
        reason = (f"the {bind.name} budget ${bind.budget_usd:.2f} opens in {bind.start - obs.now:.0f} s and "
                  f"allows {ceiling} replicas over its {bind.end - bind.start:.0f} s")
    elif capped:
        reason = (f"the {bind.name} budget ${bind.budget_usd:.2f} allows {ceiling} replicas "
                  f"(spent ${bind.spent_usd:.2f}, projected ${bind.projected_usd:.2f})")
    else:
        reason = f"within budget: projected ${bind.projected_usd:.2f} of ${bind.budget_usd:.2f} ({bind.name})"
    return BudgetView(False, bind.name, None, bind.spent_usd, bind.projected_usd, bind.budget_usd, ceiling,
                      capped, burn, reason, tuple(views), soon)
