"""The budget governor on a real fleet (gateway + sim workers as processes).

A tier priced at $1 a replica-second, with a daily budget whose reset is two
to three minutes away, so a whole "day" plays out inside the test: one
replica fits the budget, three do not. When the burst brings three
replicas, the governor marks the tier exhausted: speculative calls get a
typed `budget_exhausted` 429 with Retry-After to the reset, committed calls
are still served, and the ceiling the governor publishes for the scaler is
below what runs. When the fleet steps down, the valve opens again.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import httpx
import pytest
import yaml
from redis.asyncio import Redis

from fleet.policy import TierState, decide_tier
from fleet.store.ledger import Ledger
from tests.harness import TEST_CONFIG, Fleet, wait_until

TZ = "Asia/Kolkata"  # +05:30: the window's edges are not on UTC hours
TIER = "planner"


def reset_soon() -> tuple[str, float]:
    """A reset time (HH:MM in TZ) two to three minutes from now, and its epoch seconds."""
    now = datetime.now(ZoneInfo(TZ))
    at = (now + timedelta(minutes=3)).replace(second=0, microsecond=0)
    return at.strftime("%H:%M"), at.timestamp()


@pytest.fixture
def governed(redis_url: str, tmp_path: Path) -> Iterator[tuple[Fleet, float, float]]:
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    reset_at, end = reset_soon()
    # The floor (one replica) to the reset, plus $90: a burst's extra replicas are projected
    # for their least hold (50 s, $50 each), so one extra fits and two (three running) do
    # not; a burst of under 45 s (two extras at $1/s each) leaves the floor affordable again.
    budget = round((end - time.time()) + 90, 2)
    cfg["tiers"][TIER].update(
        hourly_usd=3600.0, max_replicas=4, slots=4, scale_in_hold_s=50,
        wait_limit_s={"committed": 30.0, "interactive": 30.0, "speculative": 30.0, "background": 30.0},
        budget={"daily_usd": budget, "reset_at": reset_at, "timezone": TZ})
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    f = Fleet(redis_url, config_path=path)
    try:
        yield f, end, budget
    finally:
        f.stop()


def state(f: Fleet) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in f.r.hgetall(f.keys(TIER).budget).items()}


def call(f: Fleet, priority: str) -> httpx.Response:
    return httpx.post(f"{f.base_url}/v1/chat/completions", timeout=30,
                      headers={"X-Priority": priority},
                      json={"model": TIER, "messages": [{"role": "user", "content": "thesis"}], "max_tokens": 3,
                            "ignore_eos": True})  # exactly 3 tokens, as the last check counts


def test_budget_runs_out_sheds_below_committed_and_caps_the_ceiling(governed: tuple[Fleet, float, float]) -> None:
    f, end, budget = governed
    f.start_gateway()
    f.start_worker(TIER)

    # One replica: within budget; the governor allows two.
    s = wait_until(lambda: (st := state(f)) and st.get("window") == "daily" and st, 15, what="a budget judgement")
    assert s["exhausted"] == "0" and float(s["budget"]) == pytest.approx(budget)
    assert s["ceiling"] == "2", s
    assert call(f, "speculative").status_code == 200

    # The burst: two more replicas start (what a scaler blind to cost would do).
    burst = [f.start_worker(TIER, wait=False) for _ in range(2)]
    s = wait_until(lambda: (st := state(f))["exhausted"] == "1" and st, 60, what="the tier marked exhausted")
    assert s["window"] == "daily" and float(s["retry_at"]) == pytest.approx(end, abs=1)
    assert float(s["projected"]) >= budget > float(s["spent"])
    assert int(s["ceiling"]) <= 2  # below the three running: the scaler adds nothing and steps down
    assert "daily budget" in s["reason"]
    # What the scaler makes of it (the same policy function it calls each tick): a long
    # line that would ask for the maximum gets no new replica, and the decision says why.
    hot = TierState(waiting=200, oldest_wait_s=10.0, arrival_rate=50.0, service_rate=5.0, ready=3, starting=0,
                    per_replica_rate=5.0, startup_s=1.0, budget_ceiling=int(s["ceiling"]))
    d = decide_tier(hot, f.cfg.tiers[TIER], time.time())
    assert d.delta <= 0 and d.ceiling_by == "budget" and d.ceiling == int(s["ceiling"]), d

    r = call(f, "speculative")
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["tier"], err["priority"]) == ("at_capacity", "budget_exhausted", TIER,
                                                                        "speculative")
    # Retry-After runs to the reset, not a guess.
    assert abs(int(r.headers["retry-after"]) - (end - time.time())) <= 5
    assert call(f, "interactive").json()["error"]["code"] == "budget_exhausted"
    committed = call(f, "committed")  # the calls that matter are still served
    assert committed.status_code == 200 and committed.json()["usage"]["completion_tokens"] == 3

    status = httpx.get(f"{f.base_url}/v1/fleet/status", timeout=10).json()["tiers"][TIER]
    assert status["budget"]["exhausted"] and status["budget_usd"] == pytest.approx(budget)
    assert status["budget_ceiling"] <= 2 and status["spend_usd"] <= budget
    assert status["replica_hours"]["total"] > 0 and status["replica_hours"]["starting"] > 0
    assert status["cost_per_million_useful_tokens_usd"] > 0  # two useful calls so far
    metrics = httpx.get(f"{f.base_url}/metrics", timeout=10).text
    for name in (f'fleet_budget_usd{{tier="{TIER}",window="daily"}} {budget}',
                 f'fleet_spend_usd_total{{tier="{TIER}"}}',
                 f'fleet_projected_spend_usd{{tier="{TIER}",window="daily"}}',
                 f'fleet_cost_per_million_tokens_usd{{tier="{TIER}"}}'):
        assert name in metrics, name

    # The fleet steps down to the floor: the projection falls under the budget, the valve opens.
    for rid in burst:
        f.kill_worker(rid, signal.SIGTERM)
    wait_until(lambda: state(f)["exhausted"] == "0", 60, what="the budget no longer exhausted")
    assert call(f, "speculative").status_code == 200

    # Spend never ran past the budget: the governor acted on the projection, long before.
    async def spent() -> float:
        r = Redis.from_url(f.redis_url)
        try:
            return await Ledger(r, f.namespace, TIER, f.cfg.tiers[TIER]).spent_usd(end - 86400, time.time())
        finally:
            await r.aclose()

    total = asyncio.run(spent())
    assert 0 < total <= budget
