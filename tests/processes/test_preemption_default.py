"""Committed work is served out of the box: on the shipped configs/fleet.yaml, as `make up` runs
it, a committed call's time to first token with every slot of the replica busy with background
work stays within 2x its time on an idle replica (plus half a second), on every tier.

Before issue 24 preemption was off by default: a committed stream on the planner waited 9.6 s for
its first token behind 400-token background calls, against 35 ms idle."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
from redis.asyncio import Redis

from fleet.config import DEFAULT_CONFIG, Priority, load_config
from fleet.store.line import Line
from tests.harness import Fleet, call_payload, wait_until

CALLS = 6  # committed calls per phase, in pairs: one takes the reserved slot, the other preempts
COMMITTED_TOKENS = 64  # long enough that the first of a pair still holds the reserved slot
SLACK_S = 0.5


@pytest.fixture(params=["routing", "analysis", "planner"])
def shipped(request: pytest.FixtureRequest, redis_url: str) -> Iterator[tuple[Fleet, str]]:
    """A gateway and one replica of `tier` on the shipped config; only the sim's model load is
    skipped (the planner's 18 s cold start), nothing about slots, classes or preemption."""
    tier = request.param
    t = tier.upper()
    f = Fleet(redis_url, config_path=DEFAULT_CONFIG,
              env_overrides={f"FLEET_TIERS__{t}__SIM__WEIGHTS_GB": "0", f"FLEET_TIERS__{t}__SIM__WARMUP_S": "0"})
    try:
        f.start_gateway()
        f.start_worker(tier)
        yield f, tier
    finally:
        f.stop()


def _ttft(f: Fleet, tier: str) -> tuple[float, str]:
    """A committed streaming call through the gateway, read to its end: seconds to its first token,
    and its request id."""
    t0 = time.monotonic()
    first = 0.0
    with httpx.stream("POST", f"{f.base_url}/v1/chat/completions", timeout=60,
                      headers={"x-priority": "committed", "x-deadline-ms": "60000"},
                      json={"model": tier, "max_tokens": COMMITTED_TOKENS, "stream": True, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "the thesis, now"}]}) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if not first and line.startswith("data: {") and orjson.loads(line[6:])["choices"][0]["delta"].get(
                    "content"):
                first = time.monotonic() - t0
            if line == "data: [DONE]":
                break
    assert first, "the stream ended without a token"
    return first, rid


def _pairs(f: Fleet, tier: str) -> list[tuple[float, str]]:
    """CALLS committed calls, two at once, half a second apart: (TTFT, request id) each."""
    out: list[tuple[float, str]] = []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(CALLS // 2):
            out += pool.map(lambda _: _ttft(f, tier), range(2), timeout=60)
            time.sleep(0.5)
    return out


def _fill(f: Fleet, tier: str, slots: int) -> None:
    """Background generations of thousands of tokens, straight onto the line (past admission,
    which would shed such long background calls on the small tiers): one for every slot."""
    async def go() -> None:
        r = Redis.from_url(f.redis_url)
        line = Line(r, f.namespace, tier)
        payload = call_payload("summarise the day", 4000, ignore_eos=True)
        for _ in range(slots):
            await line.enqueue(uuid.uuid4().hex, Priority.background, payload, 600_000)
        await r.aclose()

    asyncio.run(go())


def test_committed_ttft_with_every_slot_busy_with_background_work_on_the_default_config(
        shipped: tuple[Fleet, str]) -> None:
    f, tier = shipped
    tc = load_config(DEFAULT_CONFIG).tiers[tier]
    assert tc.preemption.enabled, "the shipped config must preempt for committed work"
    idle = [t for t, _ in _pairs(f, tier)]
    _fill(f, tier, tc.slots)
    held = tc.slots - tc.preemption.reserved_slots.get("committed", 0)
    wait_until(lambda: f.r.zcard(f.keys(tier).inflight) >= held, 20, what="every slot busy with background work")
    full = _pairs(f, tier)
    bound = 2 * statistics.median(idle) + SLACK_S
    preempted = f.counters(tier).get("preempted", 0)
    print(f"\n{tier}: committed TTFT idle {[round(x * 1000) for x in idle]} ms, slots full "
          f"{[round(t * 1000) for t, _ in full]} ms; preempted {preempted}")
    slow = [(t, f.r.hmget(f.keys(tier).request(rid), "enq", "claimed")) for t, rid in full if t > bound]
    # (enq, claimed: when it joined the line and when a replica took it, Redis clock ms)
    assert not slow, f"{tier}: committed calls waited behind background work (idle median " \
                     f"{statistics.median(idle):.3f} s): {slow}"
    assert preempted >= 1, "the second call of a pair found no slot yet preempted nothing"
