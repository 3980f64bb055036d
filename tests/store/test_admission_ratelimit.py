"""Per-key rpm/tpm windows on a real Redis: atomic under a burst, settled with the real count."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from fleet.store.key_limits import Limited, RateLimiter, Taken
from fleet.store.keys import ApiKeyKeys


@pytest.fixture
async def limiter(redis_url: str):
    r = Redis.from_url(redis_url, max_connections=256)
    yield RateLimiter(r, f"t{uuid.uuid4().hex[:8]}")
    await r.aclose()


async def test_sixty_concurrent_on_a_20_rpm_key_take_exactly_20(limiter: RateLimiter) -> None:
    got = await asyncio.gather(*(limiter.reserve("k", rpm=20, tpm=None, tokens=10) for _ in range(60)))
    taken = [g for g in got if isinstance(g, Taken)]
    refused = [g for g in got if isinstance(g, Limited)]
    assert len(taken) == 20 and len(refused) == 40
    # Everything was counted in this very minute: the window frees up about 60 s from now.
    assert all(r.limit == "rpm" and 55 <= r.retry_after_s <= 60 for r in refused)


async def test_release_gives_the_request_back(limiter: RateLimiter) -> None:
    first = await limiter.reserve("k", rpm=1, tpm=None, tokens=5)
    assert isinstance(first, Taken)
    assert isinstance(await limiter.reserve("k", rpm=1, tpm=None, tokens=5), Limited)
    await limiter.release(first)
    assert isinstance(await limiter.reserve("k", rpm=1, tpm=None, tokens=5), Taken)


async def test_tokens_are_reserved_then_settled_to_the_real_count(limiter: RateLimiter) -> None:
    big = await limiter.reserve("k", rpm=None, tpm=300, tokens=250)
    assert isinstance(big, Taken)
    over = await limiter.reserve("k", rpm=None, tpm=300, tokens=100)
    assert isinstance(over, Limited) and over.limit == "tpm"
    await limiter.settle(big, 40)  # it used far less than its max_tokens allowed
    assert isinstance(await limiter.reserve("k", rpm=None, tpm=300, tokens=250), Taken)  # 40 + 250 <= 300


async def test_a_request_bigger_than_the_whole_tpm_is_refused(limiter: RateLimiter) -> None:
    got = await limiter.reserve("k", rpm=None, tpm=100, tokens=101)
    assert isinstance(got, Limited) and got.limit == "tpm" and got.retry_after_s == 60


async def test_old_buckets_leave_the_window(limiter: RateLimiter) -> None:
    # Write a full minute's worth into a bucket 61 s old: it no longer counts, and is cleaned up.
    r = limiter._reserve.registered_client
    key = ApiKeyKeys(limiter.namespace, "k").window
    sec, _ = await r.time()
    await r.hset(key, mapping={f"r:{sec - 61}": 100, f"t:{sec - 61}": 10_000})
    assert isinstance(await limiter.reserve("k", rpm=5, tpm=500, tokens=10), Taken)
    assert await r.hexists(key, f"r:{sec - 61}") == 0
