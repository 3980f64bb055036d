"""The spend ledger against a real Redis: replica-seconds by state, exactly once; tokens; windows."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from fleet.config import TierConfig
from fleet.policy.tier_budget import token_burn_since
from fleet.store.connection import connect
from fleet.store.ledger import NANO, Ledger, TokenCharge, plan_fields


@pytest_asyncio.fixture
async def redis(store_url: str) -> AsyncIterator[Redis]:
    """The session's server, or its cluster where a test is parametrized so (`store_url`)."""
    r = connect(store_url)
    yield r  # type: ignore[misc]
    await r.aclose()


def ledger(redis: Redis, **tc: object) -> Ledger:
    return Ledger(redis, f"t{uuid.uuid4().hex[:8]}", "planner", TierConfig(**tc))  # type: ignore[arg-type]


async def marks(lg: Ledger) -> dict[str, tuple[int, str, str]]:
    out = {}
    for k, v in (await lg.redis.hgetall(lg.keys.ledger_beats)).items():
        ms, state, born = v.decode().split("|")
        out[k.decode()] = (int(ms), state, born)
    return out


async def test_every_replica_second_is_charged_once_whoever_reports_it(redis: Redis) -> None:
    lg = ledger(redis, hourly_usd=3600.0)  # $1 a replica-second
    started = time.time() - 2.0
    first = await lg.accrue("r1", "starting", started)
    assert 1.9 <= first <= 10  # from the process start: the cold start is billed
    # Fifty concurrent reports of the same replica (a retried beat, two parts reporting it).
    await asyncio.gather(*(lg.accrue("r1", "starting", started) for _ in range(50)))
    await asyncio.sleep(0.2)
    await lg.accrue("r1", "ready", started)
    mark_ms = (await marks(lg))["r1"][0]
    tot = await lg.totals()
    # The charged seconds are exactly the span from process start to the last mark: no overlap, no gap.
    assert tot.replica_s["starting"] == pytest.approx((mark_ms - int(started * 1000)) / 1000, abs=1e-3)
    assert tot.replica_s["ready"] == 0  # the state a beat reports applies from that beat on
    assert tot.usd == pytest.approx(sum(tot.replica_s.values()), abs=1e-6)


async def test_state_intervals_and_a_clean_exit(redis: Redis) -> None:
    lg = ledger(redis, hourly_usd=1.2)
    started = time.time()
    at = []
    for state, final in (("starting", False), ("ready", False), ("draining", False), ("draining", True)):
        await lg.accrue("r1", state, started, final=final)
        at.append((await marks(lg))["r1"][0] / 1000)
        await asyncio.sleep(0.2)
    # Each interval goes to the state the replica was in over it: the one its opening beat reported.
    tot = await lg.totals()
    assert tot.replica_s["starting"] == pytest.approx(at[1] - started, abs=2e-3)
    assert tot.replica_s["ready"] == pytest.approx(at[2] - at[1], abs=1e-3)
    assert tot.replica_s["draining"] == pytest.approx(at[3] - at[2], abs=1e-3)
    assert min(at[2] - at[1], at[3] - at[2]) >= 0.2
    assert (await marks(lg))["r1"][1] == "gone"
    await asyncio.sleep(0.2)
    assert await lg.accrue("r1", "ready", started) == 0  # gone: nothing more for this process
    # A new process reusing the id is a new incarnation, charged from its own start, but
    # never over time already charged to the old one (here it claims a start before the exit).
    gone_at = (await marks(lg))["r1"][0] / 1000
    charged = await lg.accrue("r1", "starting", gone_at - 5)
    assert charged == pytest.approx((await marks(lg))["r1"][0] / 1000 - gone_at, abs=1e-3) and charged < 5
    # Dollars: replica-seconds * hourly / 3600, exact to the nano-dollar per minute bucket.
    tot = await lg.totals()
    assert tot.usd == pytest.approx(sum(tot.replica_s.values()) * 1.2 / 3600, abs=1e-8)


async def test_a_silence_longer_than_the_cap_is_not_billed(redis: Redis) -> None:
    lg = ledger(redis, hourly_usd=1.0)
    charged = await lg.accrue("r1", "starting", time.time() - 3 * 3600)
    assert charged == pytest.approx(300, abs=1)  # MAX_GAP_S


async def test_windows_sum_to_the_minute_across_buckets(redis: Redis) -> None:
    lg = ledger(redis, hourly_usd=3600.0)
    now = time.time()
    charged = await lg.accrue("r1", "ready", now - 250)  # 250 s spread over 5 or 6 minute buckets
    mark = (await marks(lg))["r1"][0] / 1000
    assert charged == pytest.approx(250, abs=5)
    whole = await lg.window(now - 3600, mark)
    assert whole.replica_s["starting"] == pytest.approx(charged, abs=1e-3)
    assert whole.usd == pytest.approx(charged, abs=1e-6)
    # Minute by minute, the windows add up to the whole: nothing lost at the edges.
    first_minute = (now - 250) // 60 * 60
    parts = [await lg.window(t, t + 60) for t in range(int(first_minute), int(mark) + 60, 60)]
    assert sum(p.usd for p in parts) == pytest.approx(whole.usd, abs=1e-9)
    # A window that starts after this spend sees none of it.
    assert (await lg.window(mark + 60, mark + 120)).usd == 0


def test_plan_fields_uses_days_then_hours_then_minutes() -> None:
    plan = plan_fields(86400 - 120, 3 * 86400 + 3600 + 90)
    assert plan[0] == ["m1438:", "m1439:"]
    assert plan[1] == ["d:"] and plan[2] == ["d:"]
    assert plan[3] == ["h72:", "m4380:", "m4381:"]  # 90 s rounds up: the partial minute counts


async def test_tokens_by_key_and_class_and_what_counts_as_useful(redis: Redis) -> None:
    lg = ledger(redis, hourly_usd=0.0, usd_per_million_tokens=2.0)
    await lg.record_tokens("desk-7", "committed", 100, 50, useful=True)
    await lg.record_tokens("desk-7", "speculative", 100, 20, useful=False)  # late: cost, not useful
    await lg.record_tokens("", "interactive", 10, 5, useful=True)
    tot = await lg.totals()
    assert (tot.tokens, tot.completion_tokens, tot.useful_tokens) == (285, 75, 55)
    assert tot.usd == pytest.approx(285 * 2.0 / 1e6, abs=1e-9) and tot.token_usd == tot.usd
    by = await lg.tokens_by_key()
    assert by[("desk-7", "committed")] == {"pt": 100, "ct": 50, "ut": 50}
    assert by[("desk-7", "speculative")] == {"pt": 100, "ct": 20, "ut": 0}
    assert by[("-", "interactive")]["ut"] == 5
    today = int(time.time() // 86400)
    assert (await lg.tokens_by_key(today))[("desk-7", "committed")]["ct"] == 50
    day = await lg.window(time.time() - 60, time.time())
    assert day.useful_tokens == 55 and day.usd * NANO == pytest.approx(570_000, abs=1)
    now = time.time()
    assert await lg.token_usd_since(token_burn_since(now), now) == pytest.approx(tot.token_usd, abs=1e-9)


@pytest.mark.parametrize("store_url", ["redis", "cluster"], indirect=True)
async def test_charges_of_many_ended_calls_go_together_and_add_up_exactly(redis: Redis) -> None:
    """A busy replica charges the calls that end within one window in one round trip
    (`workers.charging`): the totals are those of charging each alone, and what waits when the
    replica stops is sent, not lost; on Redis Cluster too (a cluster pipeline refuses
    `evalsha`: every batch was lost there)."""
    from workers.charging import Charges

    lg = ledger(redis, hourly_usd=0.0, usd_per_million_tokens=1.0)
    sent: list[int] = []
    record_many = lg.record_many

    async def counted(charges):  # type: ignore[no-untyped-def]
        sent.append(len(charges))
        await record_many(charges)

    lg.record_many = counted  # type: ignore[method-assign]
    charges = Charges(lg, window_s=0.05)
    for i in range(50):  # 50 calls ending at once, then 50 more while the first round trip runs
        charges.add(TokenCharge(f"k{i % 5}", "interactive", 10, 4, useful=i % 2 == 0))
    await asyncio.sleep(0)
    for i in range(50):
        charges.add(TokenCharge(f"k{i % 5}", "interactive", 10, 4, useful=True))
    await charges.stop()
    tot = await lg.totals()
    assert (tot.tokens, tot.completion_tokens, tot.useful_tokens) == (1400, 400, 300)
    assert sum(sent) == 100 and len(sent) <= 3  # a round trip per call would be 100
    assert (await lg.tokens_by_key())[("k0", "interactive")] == {"pt": 200, "ct": 80, "ut": 60}
