"""Per-key dollar budgets in Redis: reserve, settle, release; atomic under concurrency. Through the
gateway: tests/processes/test_budget_keys.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from fleet.store.key_budget import KeyBudget


@pytest_asyncio.fixture
async def kb(redis_url: str) -> AsyncIterator[KeyBudget]:
    r = Redis.from_url(redis_url, max_connections=256)
    yield KeyBudget(r, f"t{uuid.uuid4().hex[:8]}")
    await r.aclose()


async def test_200_concurrent_reservations_on_a_budget_for_50_take_exactly_50(kb: KeyBudget) -> None:
    cost = 0.007
    got = await asyncio.gather(*(kb.reserve("desk", f"r{i}", cost, 50 * cost, ttl_ms=60_000) for i in range(200)))
    ok = [g for g in got if g.ok]
    assert len(ok) == 50
    assert all(g.left_usd < cost for g in got if not g.ok)
    st = await kb.state("desk")
    assert st["reserved"] == pytest.approx(50 * cost) and st["open"] == 50
    # Every admitted call settles at its full worst case: the key ends exactly at its budget, not a cent over.
    await asyncio.gather(*(kb.settle("desk", g.rid, cost) for g in ok))
    st = await kb.state("desk")
    assert st["spent"] == pytest.approx(50 * cost, abs=1e-9) and st["reserved"] == 0 and st["open"] == 0
    assert not (await kb.reserve("desk", "late", 0.000001, 50 * cost, ttl_ms=60_000)).ok


async def test_settle_charges_the_real_cost_and_release_gives_it_back(kb: KeyBudget) -> None:
    assert (await kb.reserve("k", "a", 1.0, 2.0, ttl_ms=60_000)).ok
    assert (await kb.reserve("k", "b", 1.0, 2.0, ttl_ms=60_000)).ok
    assert not (await kb.reserve("k", "c", 0.5, 2.0, ttl_ms=60_000)).ok  # 2.0 held already
    assert await kb.settle("k", "a", 0.25) == pytest.approx(0.25)  # used less than its worst case
    await kb.release("k", "b")  # refused further on, expired or cancelled
    assert await kb.settle("k", "a", 0.25) == 0  # a second settle finds nothing: idempotent
    await kb.release("k", "b")
    st = await kb.state("k")
    assert (st["spent"], st["reserved"], st["open"]) == (pytest.approx(0.25), 0, 0)
    assert (await kb.reserve("k", "c", 1.75, 2.0, ttl_ms=60_000)).ok  # what was given back is usable
    # An estimate that ran short never pushes the key past its budget; the excess is reported.
    assert await kb.settle("k", "c", 1.9) == pytest.approx(1.75)
    st = await kb.state("k")
    assert st["spent"] == pytest.approx(2.0) and st["unbilled"] == pytest.approx(0.15)


async def test_a_reservation_left_behind_is_swept_after_its_expiry(kb: KeyBudget) -> None:
    assert (await kb.reserve("k", "orphan", 1.0, 1.0, ttl_ms=200)).ok  # its gateway died before settling
    assert not (await kb.reserve("k", "next", 1.0, 1.0, ttl_ms=60_000)).ok
    # Waited on the condition itself (a refused reserve holds nothing), not on a guess of the sweep.
    loop = asyncio.get_running_loop()
    end = loop.time() + 5.0
    while not (await kb.reserve("k", "next", 1.0, 1.0, ttl_ms=60_000)).ok:
        assert loop.time() < end, "the orphan's reservation was never swept"
        await asyncio.sleep(0.05)
    assert await kb.settle("k", "orphan", 1.0) == 0  # the swept one can no longer be charged
