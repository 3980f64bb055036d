"""The budget governor's math (pure): cost per useful token, windows, projection, ceiling."""

from __future__ import annotations

import math
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from fleet.config import Budget, BudgetWindow, ConfigError, TierConfig, load_config
from fleet.policy import cost_per_million_tokens
from fleet.policy.key_budget import key_usd_per_million
from fleet.policy.tier_budget import (
    BudgetObservation,
    budget_ceiling,
    budget_day,
    budget_lead_s,
    burst_ceiling,
    cost_per_useful_million,
    daily_window,
    judge,
    least_spend,
    named_windows,
    projected_spend,
    replica_cost_usd_per_s,
    replica_usd_per_s,
    shedding_saves,
)

NY = ZoneInfo("America/New_York")


def at(*args: int, tz: ZoneInfo = NY) -> float:
    return datetime(*args, tzinfo=tz).timestamp()


# --- The chapter's worked example ---------------------------------------------


def test_chapter_cost_per_million_useful_tokens() -> None:
    # $2/hour at 100 useful output tokens/s is about $5.5556 per million.
    assert cost_per_million_tokens(2.0, 100.0) == pytest.approx(5.5556, abs=1e-4)
    # Useful throughput halves: cost doubles, to about $11.1111.
    assert cost_per_million_tokens(2.0, 50.0) == pytest.approx(11.1111, abs=1e-4)
    assert cost_per_million_tokens(2.0, 50.0) == pytest.approx(2 * cost_per_million_tokens(2.0, 100.0))
    # The ledger's form, over an hour: $2 spent, 360,000 useful tokens.
    assert cost_per_useful_million(2.0, 360_000, 3600.0) == pytest.approx(5.5556, abs=1e-4)
    assert cost_per_useful_million(2.0, 180_000, 3600.0) == pytest.approx(11.1111, abs=1e-4)
    # No useful tokens yet: the cost is unbounded, not zero.
    assert cost_per_useful_million(2.0, 0, 3600.0) == math.inf


def test_key_price_per_million() -> None:
    assert key_usd_per_million(TierConfig(hourly_usd=2.0, usd_per_million_tokens=0.5), 100.0) == 0.5
    assert key_usd_per_million(TierConfig(hourly_usd=2.0), 100.0) == pytest.approx(5.5556, abs=1e-4)
    assert key_usd_per_million(TierConfig(hourly_usd=0.0), 100.0) == 0.0


# --- Windows ---------------------------------------------------------------------


def test_daily_window_resets_in_its_time_zone() -> None:
    b = Budget(daily_usd=100, reset_at="06:00", timezone="America/New_York")
    w = daily_window(b, at(2026, 11, 3, 7, 30))
    assert w and (w.start, w.end) == (at(2026, 11, 3, 6, 0), at(2026, 11, 4, 6, 0)) and w.usd == 100
    # Before the reset it is still yesterday's window.
    w = daily_window(b, at(2026, 11, 3, 5, 59))
    assert w and (w.start, w.end) == (at(2026, 11, 2, 6, 0), at(2026, 11, 3, 6, 0))
    # Exactly at the reset, the new window has begun.
    assert daily_window(b, at(2026, 11, 3, 6, 0)).start == at(2026, 11, 3, 6, 0)  # type: ignore[union-attr]
    # The day DST ends (1 Nov 2026 in New York) is 25 hours long at midnight reset.
    start, end = budget_day(Budget(timezone="America/New_York"), at(2026, 11, 1, 12, 0))
    assert end - start == 25 * 3600
    assert daily_window(Budget(), at(2026, 11, 3, 7, 30)) is None  # no daily budget


def test_named_window_open_on_weekdays() -> None:
    b = Budget(timezone="America/New_York",
               windows=[BudgetWindow(name="open", cron="25 8 * * 1-5", duration_s=5700, usd=60)])
    # Tuesday 08:34, in the open.
    (w,) = named_windows(b, at(2026, 11, 3, 8, 34))
    assert (w.name, w.start, w.end, w.usd) == ("open", at(2026, 11, 3, 8, 25), at(2026, 11, 3, 10, 0), 60)
    assert named_windows(b, at(2026, 11, 3, 8, 25))[0].start == at(2026, 11, 3, 8, 25)  # starts exactly now
    assert named_windows(b, at(2026, 11, 3, 10, 0)) == []  # [start, end): over at 10:00
    assert named_windows(b, at(2026, 11, 3, 8, 24, 59)) == []
    assert named_windows(b, at(2026, 11, 7, 8, 34)) == []  # Saturday


def test_bad_budget_config_names_the_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cases = {
        "reset_at: '25:00'": "tiers.t.budget.reset_at",
        "timezone: Mars/Olympus": "tiers.t.budget.timezone",
        "windows: [{name: open, cron: 'not cron', duration_s: 60, usd: 1}]": "tiers.t.budget.windows.0.cron",
        "daily_usd: -1": "tiers.t.budget.daily_usd",
    }
    for line, field in cases.items():
        p = tmp_path / "f.yaml"
        p.write_text(f"tiers:\n  t:\n    budget:\n      {line}\n")
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(p)
    # Spend is kept by window name: a name may appear once, and `daily` is the daily budget's.
    for windows, why in [("[{name: open, cron: '25 8 * * *', duration_s: 60, usd: 1},"
                          " {name: open, cron: '0 14 * * *', duration_s: 60, usd: 1}]", "unique"),
                         ("[{name: daily, cron: '25 8 * * *', duration_s: 60, usd: 1}]", "reserved")]:
        p = tmp_path / "f.yaml"
        p.write_text(f"tiers:\n  t:\n    budget:\n      windows: {windows}\n")
        with pytest.raises(ConfigError, match=rf"tiers\.t\.budget\.windows.*{why}"):
            load_config(p)


# --- Projection and ceiling ----------------------------------------------------


def test_projected_spend_is_spent_plus_burn_over_the_rest() -> None:
    now = 1_000.0
    assert projected_spend(10.0, 0.01, now, now + 3600) == pytest.approx(46.0)
    assert projected_spend(10.0, 0.01, now, now - 5) == 10.0  # window over: only what was spent
    assert projected_spend(10.0, -1.0, now, now + 100) == 10.0  # no negative burn


def test_budget_ceiling_on_constructed_states() -> None:
    now, end = 0.0, 5700.0  # the open: 95 minutes left
    per = 9.80 / 3600  # a planner replica
    # $60 for the open: 3 replicas cost $46.55, 4 cost $62.07.
    assert budget_ceiling(60.0, 0.0, now, end, per) == 3
    # $20 already spent: 2 replicas for the rest ($31.03) fit, 3 ($46.55) do not.
    assert budget_ceiling(60.0, 20.0, now, end, per) == 2
    # Exactly affordable counts: $1/s replicas, 100 s left, $300 budget -> 3.
    assert budget_ceiling(300.0, 0.0, 0.0, 100.0, 1.0) == 3
    # Per-token burn takes its share first.
    assert budget_ceiling(300.0, 0.0, 0.0, 100.0, 1.0, other_burn_usd_per_s=1.5) == 1
    # Overspent: zero, never negative. Free replicas or a closed window: no bound.
    assert budget_ceiling(60.0, 70.0, now, end, per) == 0
    assert budget_ceiling(60.0, 0.0, now, end, 0.0) is None
    assert budget_ceiling(60.0, 0.0, end, end, per) is None


def _planner(**budget: object) -> TierConfig:
    return TierConfig(hourly_usd=9.80, max_replicas=6, budget=Budget(timezone="America/New_York", **budget))


OPEN = [BudgetWindow(name="open", cron="25 8 * * 1-5", duration_s=5700, usd=60)]


def test_judge_lets_a_burst_spend_the_open_window() -> None:
    """The projection counts that a burst's extra replicas leave after it: the floor for the
    rest of the window, each extra for one hold (the scaler steps down to the need a hold
    after the burst). The ceiling is the most replicas whose least spend fits; burning
    today's fleet to the window's end would have allowed 3 and left most of the $60 idle."""
    tc = _planner(daily_usd=1500, windows=OPEN).model_copy(update={"max_replicas": 400})
    p = replica_usd_per_s(tc)
    now = at(2026, 11, 3, 8, 25)
    v = judge(tc, BudgetObservation(now=now, replicas=3, spent_usd={"daily": 10.0, "open": 0.0}))
    assert not v.exhausted and v.retry_at is None
    assert {w.name for w in v.windows} == {"daily", "open"}
    (w,) = [w for w in v.windows if w.name == "open"]
    n = w.ceiling
    assert n is not None and n > 3 * 5 and v.ceiling is not None and v.ceiling <= n
    assert least_spend(0.0, n, 1, 5700, 30, p) <= 60 < least_spend(0.0, n + 1, 1, 5700, 30, p)
    assert w.projected_usd == pytest.approx(p * (5700 + 2 * 30))  # the floor all along, two extras a hold each
    assert budget_ceiling(60, 0.0, now, now + 5700, p) == 3  # the old rule, for comparison


def test_least_spend_and_the_burst_ceiling() -> None:
    p = 10.0 / 3600
    # Floor 2 all along (1000 s), then three extras for one hold of 100 s each.
    assert least_spend(5.0, 5, 2, 1000, 100, p) == pytest.approx(5.0 + p * (2 * 1000 + 3 * 100))
    # A hold longer than what is left of the window: each extra runs to its end.
    assert least_spend(0.0, 4, 1, 50, 100, p) == pytest.approx(p * (50 + 3 * 50))
    for budget in (6.0, 7.5, 9.0, 20.0):
        n = burst_ceiling(budget, 0.0, 2, 1000, 100, p)
        assert n is not None and n >= 2
        assert least_spend(0.0, n, 2, 1000, 100, p) <= budget + 1e-9 < least_spend(0.0, n + 1, 2, 1000, 100, p)
    # Even the floor does not fit: the burn-to-the-end rule, below the floor.
    assert burst_ceiling(5.0, 0.0, 2, 1000, 100, p) == 1
    assert burst_ceiling(1.0, 0.0, 2, 0, 100, p) is None  # the window is over


def test_judge_exhausted_when_the_running_fleet_cannot_be_afforded() -> None:
    tc = _planner(daily_usd=1500, windows=OPEN)
    now = at(2026, 11, 3, 8, 34)  # 86 minutes of the open left
    v = judge(tc, BudgetObservation(now=now, replicas=5, spent_usd={"daily": 100.0, "open": 50.0}))
    assert v.exhausted and v.window == "open"
    assert v.retry_at == at(2026, 11, 3, 10, 0)  # Retry-After runs to the open's end
    assert v.projected_usd >= v.budget_usd == 60  # type: ignore[operator]
    # ($60 - $50) / ($9.80/h * 86 min = $14.05 a replica) = 0.7: not even the floor fits.
    assert v.ceiling == 0 and v.capped
    assert "reaches the open budget" in v.reason


def test_judge_spent_out_daily_budget_retries_at_the_reset() -> None:
    tc = _planner(daily_usd=100, reset_at="06:00")
    now = at(2026, 11, 3, 20, 0)
    # Two running, one above the floor: shedding lets it go (at the floor alone, see below).
    v = judge(tc, BudgetObservation(now=now, replicas=2, spent_usd={"daily": 100.0}))
    assert v.exhausted and v.window == "daily" and v.ceiling == 0
    assert v.retry_at == at(2026, 11, 4, 6, 0)


def test_judge_without_budget_or_with_per_token_burn() -> None:
    v = judge(TierConfig(hourly_usd=1.0, max_replicas=4), BudgetObservation(now=0.0, replicas=2))
    assert not v.exhausted and v.ceiling is None and not v.capped and v.budget_usd is None
    # A tier billed by tokens: the token burn alone can exhaust it.
    tc = TierConfig(hourly_usd=0.0, usd_per_million_tokens=10.0, max_replicas=4,
                    budget=Budget(daily_usd=50, timezone="UTC"))
    now = datetime(2026, 11, 3, 23, 0, tzinfo=ZoneInfo("UTC")).timestamp()  # an hour to the reset
    calm = judge(tc, BudgetObservation(now=now, replicas=4, spent_usd={"daily": 40.0}, token_burn_usd_per_s=0.001))
    assert not calm.exhausted and calm.ceiling is None  # replicas are free here: no cap
    hot = judge(tc, BudgetObservation(now=now, replicas=4, spent_usd={"daily": 40.0}, token_burn_usd_per_s=0.01))
    assert hot.exhausted and hot.projected_usd == pytest.approx(40.0 + 36.0)


def test_a_burst_s_tokens_are_carried_by_its_replicas_not_projected_to_the_window_s_end() -> None:
    """market-open's planner: $9.80/h a replica and $4 per million tokens, six replicas at a full
    batch burning $0.03/s of tokens, 75 minutes of a $95 open window left. Projecting that burn
    to the window's end put the ceiling at 0: the tier stepped down to its floor, the burn fell,
    the ceiling came back and it scaled out again (two flaps). The tokens go with the replicas
    that serve them: the floor's for the rest of the window, each extra one's for its hold."""
    windows = [BudgetWindow(name="open", cron="25 8 * * 1-5", duration_s=5700, usd=95)]
    tc = TierConfig(hourly_usd=9.80, usd_per_million_tokens=4.0, max_replicas=6, warm_floor=1, scale_in_hold_s=120,
                    budget=Budget(daily_usd=1500, timezone="America/New_York", windows=windows))
    now = at(2026, 11, 30, 8, 45)
    obs = BudgetObservation(now=now, replicas=6, spent_usd={"daily": 60.0, "open": 40.0}, token_burn_usd_per_s=0.03)
    v = judge(tc, obs)
    rest = at(2026, 11, 30, 10, 0) - now
    each = replica_usd_per_s(tc) + 0.03 / 6  # a replica's price and its share of the tokens
    assert replica_cost_usd_per_s(replica_usd_per_s(tc), 0.03, 6) == (pytest.approx(each), 0.0)
    assert not v.exhausted and v.window == "open"
    assert v.ceiling == burst_ceiling(95, 40.0, 1, rest, 120, each) and v.ceiling >= 6
    assert v.projected_usd == pytest.approx(40.0 + each * (rest + 5 * 120))
    # The old projection, the whole burn to the end, leaves nothing: what the flaps came from.
    assert burst_ceiling(95, 40.0, 1, rest, 120, replica_usd_per_s(tc), 0.03) == 0
    # A burst that goes on spends: with $80 gone the same six are over, and the tier is capped.
    late = judge(tc, BudgetObservation(now=now, replicas=6, spent_usd={"open": 80.0}, token_burn_usd_per_s=0.03))
    assert late.ceiling is not None and late.ceiling < 6 and late.exhausted


def test_a_window_about_to_open_bounds_the_ceiling_ahead_of_it() -> None:
    """The planner at 08:24:30 ran 6 under the daily ceiling; at 08:25 a tight open window
    opened and the tier was suddenly over. The open bounds the ceiling from a lead before
    it opens (by the same least-spend projection), without shedding anything yet."""
    tight_open = [BudgetWindow(name="open", cron="25 8 * * 1-5", duration_s=5700, usd=17)]
    tc = TierConfig(hourly_usd=9.80, max_replicas=6, scale_in_hold_s=120,
                    budget=Budget(daily_usd=1500, timezone="America/New_York", windows=tight_open))
    p = replica_usd_per_s(tc)
    want = burst_ceiling(17, 0.0, 1, 5700, 120, p)
    assert want is not None and want < 6
    lead = budget_lead_s(tc, 20.0)
    assert lead == 140.0
    obs = BudgetObservation(now=at(2026, 11, 3, 8, 24, 30), replicas=6, spent_usd={"daily": 100.0})
    blind = judge(tc, obs)  # no lead: only the daily binds
    assert blind.ceiling is not None and blind.ceiling >= 6 and not blind.capped
    v = judge(tc, obs, lead_s=lead)
    assert v.ceiling == want and v.capped and v.window == "open"
    assert not v.exhausted  # nothing is shed by a window that has not opened
    assert "opens in 30 s" in v.reason and f"allows {want}" in v.reason
    assert [w.name for w in v.upcoming] == ["open"] and [w.name for w in v.windows] == ["daily"]
    # Outside the lead the open does not bind; once open it binds as an active window.
    early = judge(tc, BudgetObservation(now=at(2026, 11, 3, 8, 20), replicas=6, spent_usd={"daily": 100.0}),
                  lead_s=lead)
    assert early.ceiling != want and not early.upcoming
    opened = judge(tc, BudgetObservation(now=at(2026, 11, 3, 8, 25, 1), replicas=want,
                                         spent_usd={"daily": 100.0, "open": 0.0}), lead_s=lead)
    assert opened.ceiling == want and {w.name for w in opened.windows} == {"daily", "open"}
    # The next budget day bounds the ceiling too, as the reset approaches.
    tight = TierConfig(hourly_usd=10.0, max_replicas=8, scale_in_hold_s=120,
                       budget=Budget(daily_usd=241, reset_at="06:00", timezone="America/New_York"))
    late = judge(tight, BudgetObservation(now=at(2026, 11, 3, 5, 59), replicas=1, spent_usd={"daily": 0.0}),
                 lead_s=lead)
    day = burst_ceiling(241, 0.0, 1, 86400, 120, replica_usd_per_s(tight))
    assert day is not None and day < 8
    assert late.ceiling == day and [w.name for w in late.upcoming] == ["daily"]



# --- Shedding by budget only where it saves (decision 0083) ---------------------

AFTERNOON = [BudgetWindow(name="afternoon", cron="0 14 * * 1-5", duration_s=7200, usd=40)]


def _analysis(**over: object) -> TierConfig:
    """budget-runs-out's analysis tier: $2.50 a replica-hour, a floor of two, a $40 afternoon."""
    base: dict[str, object] = {"hourly_usd": 2.50, "warm_floor": 2, "max_replicas": 20, "scale_in_hold_s": 60,
                               "budget": Budget(daily_usd=900, timezone="America/New_York", windows=AFTERNOON)}
    return TierConfig(**{**base, **over})  # type: ignore[arg-type]


KNIFE_EDGE = at(2026, 11, 30, 15, 21, 51)  # the flood has spent the window to 100.01%, 38 minutes left


def test_the_floor_of_a_tier_billed_by_the_hour_is_not_shed_by_budget() -> None:
    """budget-runs-out: the flood spent the $40 window to $40.004, so the floor is unaffordable to
    the window's end. The two floor replicas run and bill to 16:00 whatever the budget says (the
    scaler keeps the floor), so shedding the interactive calls they serve saved nothing: it refused
    6,960 of them for 38 minutes. The tier is capped at its floor, not exhausted."""
    tc = _analysis()
    obs = BudgetObservation(now=KNIFE_EDGE, replicas=2, spent_usd={"daily": 40.004, "afternoon": 40.004})
    v = judge(tc, obs)
    assert not v.exhausted and v.retry_at is None
    assert v.window == "afternoon" and v.projected_usd > v.budget_usd == 40  # type: ignore[operator]
    assert v.ceiling is not None and v.ceiling < 2 and v.capped  # no replica beyond the floor
    assert "save nothing" in v.reason
    assert [w.exhausted for w in v.windows if w.name == "afternoon"] == [True]  # the window is still reported spent
    assert not shedding_saves(tc, 2) and not shedding_saves(tc, 1)  # starting up to the floor: the same


def test_replicas_above_the_floor_are_still_shed_for() -> None:
    """One replica above the floor: shedding lets the line empty and the scaler give it back."""
    v = judge(_analysis(), BudgetObservation(now=KNIFE_EDGE, replicas=3, spent_usd={"afternoon": 40.004}))
    assert v.exhausted and v.window == "afternoon" and v.retry_at == at(2026, 11, 30, 16, 0)
    assert "reaches the afternoon budget" in v.reason


@pytest.mark.parametrize(("hourly", "per_million"), [(2.50, 4.0), (0.0, 4.0)], ids=["both", "tokens only"])
def test_a_tier_with_a_per_token_price_is_shed_for_at_its_floor(hourly: float, per_million: float) -> None:
    """Every call served costs its tokens: at the floor too, refusing it is spend saved."""
    tc = _analysis(hourly_usd=hourly, usd_per_million_tokens=per_million)
    v = judge(tc, BudgetObservation(now=KNIFE_EDGE, replicas=2, spent_usd={"afternoon": 40.004},
                                    token_burn_usd_per_s=0.001))
    assert v.exhausted and shedding_saves(tc, 2)


def test_a_floor_of_zero_keeps_nothing_so_every_replica_is_shed_for() -> None:
    """Scaled to zero, a call would start a replica the budget pays for: it is refused by budget."""
    tc = _analysis(warm_floor=0)
    v = judge(tc, BudgetObservation(now=KNIFE_EDGE, replicas=0, spent_usd={"afternoon": 40.004}))
    assert v.exhausted and v.ceiling == 0
    assert judge(tc, BudgetObservation(now=KNIFE_EDGE, replicas=1, spent_usd={"afternoon": 40.004})).exhausted


def test_a_zero_budget_on_a_free_tier_still_closes_it() -> None:
    """No price at all: nothing to save, but a $0 budget is the operator's switch, kept as it was."""
    tc = TierConfig(warm_floor=1, max_replicas=1, budget=Budget(daily_usd=0))
    assert judge(tc, BudgetObservation(now=KNIFE_EDGE, replicas=1)).exhausted
