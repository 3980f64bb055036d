"""Preemption in the workers, with the sim engine and a real Redis: a committed call
takes a slot from background work in a full tier, on one replica only, and every
request still ends with exactly one outcome and its exact tokens, counted once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from redis.asyncio import Redis

from fleet.config import FleetConfig, Preemption, Priority, load_config
from fleet.store.events import Done, Event
from fleet.store.ledger import Ledger
from fleet.store.line import Line
from tests.harness import TEST_CONFIG, Fleet, call_payload, until, wait_until
from workers.engines.sim import SimEngine
from workers.worker import Worker

TIER = "planner"  # two slots a replica, a decode step of a few ms



@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """A client of the session's private Redis, closed after the test (pass or fail)."""
    r = Redis.from_url(redis_url)
    yield r
    await r.aclose()

def _cfg(**pre: object) -> FleetConfig:
    cfg = load_config(TEST_CONFIG, namespace=f"t{uuid.uuid4().hex[:8]}")
    cfg.tiers[TIER].preemption = Preemption(enabled=True, **pre)  # type: ignore[arg-type]
    return cfg


@asynccontextmanager
async def _replicas(cfg: FleetConfig, redis: Redis, n: int) -> AsyncIterator[list[Worker]]:
    workers = [Worker(cfg, TIER, SimEngine(cfg.tiers[TIER].sim), redis, replica_id=f"r{i}") for i in range(n)]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        await _until(lambda: all(w.state == "ready" for w in workers), "replicas ready")
        yield workers
    finally:
        for w in workers:
            w.drain()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)


async def _until(pred, what: str, within_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    await until(pred, what, within_s)


async def _put(line: Line, prio: Priority, max_tokens: int, n: int = 1) -> list[str]:
    ids = []
    for _ in range(n):
        rid = uuid.uuid4().hex
        payload = call_payload("p" * 40, max_tokens, key="k1", ignore_eos=True)
        await line.enqueue(rid, prio, payload, 60_000)
        ids.append(rid)
    return ids


async def _outcome(redis: Redis, line: Line, rid: str) -> tuple[str, Event]:
    """The request's one outcome and its last event (waits for it)."""
    await _until(lambda: _state_is_done(redis, line, rid), f"{rid} to end")
    outcome = (await redis.hget(line.keys.request(rid), "outcome")).decode()
    events = await line.read_events(rid, "0-0", 100)
    return outcome, events[-1][1]


async def _state_is_done(redis: Redis, line: Line, rid: str) -> bool:
    return await redis.hget(line.keys.request(rid), "state") == b"done"


async def _done_at(redis: Redis, line: Line, rids: list[str]) -> dict[str, float]:
    """When each request ended, in the order they end (polled)."""
    seen: dict[str, float] = {}
    end = time.monotonic() + 90
    while len(seen) < len(rids) and time.monotonic() < end:
        for rid in rids:
            if rid not in seen and await _state_is_done(redis, line, rid):
                seen[rid] = time.monotonic()
        await asyncio.sleep(0.01)
    assert len(seen) == len(rids), "not every request ended"
    return seen


async def test_committed_takes_a_slot_from_background_and_everything_completes_once(redis: Redis) -> None:
    cfg = _cfg(max_preemptions=1)
    line = Line(redis, cfg.namespace, TIER)
    async with _replicas(cfg, redis, 1):
        bg = await _put(line, Priority.background, 400, 2)  # ~2 s each: both slots
        await _until(lambda: _inflight(line, 2), "background running")
        (com,) = await _put(line, Priority.committed, 8)
        ended = await _done_at(redis, line, [com, *bg])
    # The committed call did not wait for a slot to free: it ended before both background calls.
    assert ended[com] < min(ended[b] for b in bg)
    for rid, n in [(com, 8), *((b, 400) for b in bg)]:
        outcome, ev = await _outcome(redis, line, rid)
        assert outcome == "completed" and isinstance(ev, Done) and ev.completion_tokens == n  # the same response, exact
    attempts = sorted([int(await redis.hget(line.keys.request(b), "attempt")) for b in bg])
    assert attempts == [1, 2]  # exactly one victim, run again once
    snap = await line.observe()
    assert snap.counters["preempted"] == 1 and snap.counters["completed"] == 3 == snap.counters["accepted"]
    assert snap.counters["completion_tokens"] == 808  # usage counted once
    totals = await Ledger(redis, cfg.namespace, TIER, cfg.tiers[TIER]).totals()
    assert totals.completion_tokens == 808 == totals.useful_tokens  # the aborted attempt is not charged


async def _inflight(line: Line, n: int) -> bool:
    return (await line.observe()).inflight >= n


async def test_across_replicas_one_preemption_per_waiting_call_and_no_double_claim(redis: Redis) -> None:
    cfg = _cfg(max_preemptions=1)
    line = Line(redis, cfg.namespace, TIER)
    async with _replicas(cfg, redis, 2):
        bg = await _put(line, Priority.background, 300, 4)  # two replicas x two slots
        await _until(lambda: _inflight(line, 4), "background running")
        com = await _put(line, Priority.committed, 8, 2)
        ended = await _done_at(redis, line, [*com, *bg])
    assert max(ended[c] for c in com) < min(ended[b] for b in bg)
    snap = await line.observe()
    assert snap.counters["preempted"] == 2  # one per waiting call, never more
    for c in com:  # claimed once each
        assert int(await redis.hget(line.keys.request(c), "attempt")) == 1
    assert sum([int(await redis.hget(line.keys.request(b), "attempt")) for b in bg]) == 4 + 2
    assert snap.counters["completed"] == 6 == snap.counters["accepted"]


async def test_no_starvation_past_max_preemptions(redis: Redis) -> None:
    cfg = _cfg(max_preemptions=1, min_wait_ms=0)
    line = Line(redis, cfg.namespace, TIER)
    async with _replicas(cfg, redis, 1):
        bg = await _put(line, Priority.background, 150, 2)
        await _until(lambda: _inflight(line, 2), "background running")
        # A steady flow of committed calls, more than the slots could ever clear.
        com: list[str] = []
        t_end = time.monotonic() + 4
        while time.monotonic() < t_end and not all([await _state_is_done(redis, line, b) for b in bg]):
            com += await _put(line, Priority.committed, 40)
            await asyncio.sleep(0.05)
        await _done_at(redis, line, [*bg, *com])
    for b in bg:
        assert int(await redis.hget(line.keys.request(b), "preempted") or 0) <= 1
        outcome, ev = await _outcome(redis, line, b)
        assert outcome == "completed" and ev.completion_tokens == 150


def test_worker_sigkilled_while_preempting_loses_nothing(fleet: Fleet) -> None:
    fleet.env_overrides.update({f"FLEET_TIERS__{TIER.upper()}__PREEMPTION__ENABLED": "true",
                                f"FLEET_TIERS__{TIER.upper()}__PREEMPTION__MIN_WAIT_MS": "0"})
    line_keys = fleet.keys(TIER)
    victim_rid = fleet.start_worker(TIER)
    r = fleet.r

    async def put(prio: Priority, max_tokens: int, n: int) -> list[str]:
        ar = Redis.from_url(fleet.redis_url)
        try:
            return await _put(Line(ar, fleet.namespace, TIER), prio, max_tokens, n)
        finally:
            await ar.aclose()

    bg = asyncio.run(put(Priority.background, 300, 2))
    wait_until(lambda: r.zcard(line_keys.inflight) == 2, 30, what="background running")
    com = asyncio.run(put(Priority.committed, 200, 1))
    # Kill the replica the moment it has preempted: the victim is back in the line, the committed
    # call may or may not be claimed yet, the other background call is still leased to the dead one.
    wait_until(lambda: int(r.hget(line_keys.counters, "preempted") or 0) >= 1, 30, interval=0.005,
               what="a preemption")
    fleet.kill_worker(victim_rid, signal.SIGKILL)
    fleet.start_worker(TIER)  # its reaper requeues what the dead one held (not streamed: run again)
    for rid in [*bg, *com]:
        wait_until(lambda rid=rid: r.hget(line_keys.request(rid), "state") == b"done", 60, what=f"{rid} ends")
        assert r.hget(line_keys.request(rid), "outcome") == b"completed"
    c = fleet.counters(TIER)
    assert c["accepted"] == 3 == c["completed"]


def test_callers_see_only_a_longer_wait_and_the_fleet_reports_the_preemption(fleet: Fleet) -> None:
    import httpx

    fleet.env_overrides[f"FLEET_TIERS__{TIER.upper()}__PREEMPTION__ENABLED"] = "true"
    fleet.start_gateway()
    fleet.start_worker(TIER)

    def call(prio: str, max_tokens: int) -> httpx.Response:
        return httpx.post(f"{fleet.base_url}/v1/completions", timeout=60, headers={"x-priority": prio},
                          json={"model": TIER, "prompt": "digest the tape", "max_tokens": max_tokens,
                                "ignore_eos": True})  # each runs to its bound: the counts and the victim

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bg = [pool.submit(call, "background", 300) for _ in range(2)]
        wait_until(lambda: fleet.r.zcard(fleet.keys(TIER).inflight) == 2, 30, what="background running")
        com = pool.submit(call, "committed", 8)
        done = [f.result() for f in [com, *bg]]
    for resp, n in zip(done, (8, 300, 300), strict=True):
        assert resp.status_code == 200, resp.text  # no error for the victim: the same response
        assert resp.json()["usage"]["completion_tokens"] == n
    status = httpx.get(f"{fleet.base_url}/v1/fleet/status", timeout=10).json()["tiers"][TIER]
    assert status["preemptions"]["total"] == 1 == status["preemptions"]["background"]
    assert status["outcomes"]["completed"] == 3 == status["outcomes"]["accepted"]
    metrics = httpx.get(f"{fleet.base_url}/metrics", timeout=10).text
    assert f'fleet_preemptions_total{{class="background",tier="{TIER}"}} 1.0' in metrics


async def test_reserved_slots_keep_a_slot_free_for_committed_work_without_preempting(redis: Redis) -> None:
    cfg = load_config(TEST_CONFIG, namespace=f"t{uuid.uuid4().hex[:8]}")
    cfg.tiers[TIER].preemption = Preemption(enabled=False, reserved_slots={"committed": 1})
    line = Line(redis, cfg.namespace, TIER)
    async with _replicas(cfg, redis, 1):
        bg = await _put(line, Priority.background, 200, 3)
        await _until(lambda: _inflight(line, 1), "background running")
        assert (await line.observe()).by_class[Priority.background] == 2  # one of two slots is held back
        (com,) = await _put(line, Priority.committed, 8)
        ended = await _done_at(redis, line, [com, *bg])
    assert ended[com] < min(ended[b] for b in bg)
    snap = await line.observe()
    assert snap.counters.get("preempted", 0) == 0 and snap.counters["completed"] == 4


async def test_a_stream_that_has_sent_tokens_is_never_preempted(redis: Redis) -> None:
    cfg = _cfg(max_preemptions=3, min_wait_ms=0)
    line = Line(redis, cfg.namespace, TIER)
    async with _replicas(cfg, redis, 1):
        streams = []
        for _ in range(2):
            rid = uuid.uuid4().hex
            payload = call_payload("p", 200, stream=True, ignore_eos=True)
            await line.enqueue(rid, Priority.background, payload, 60_000)
            streams.append(rid)
        # Both streams have sent tokens to their callers before the committed call arrives.
        await _until(lambda: _all_streamed(redis, line, streams), "both streams sending")
        (com,) = await _put(line, Priority.committed, 8)
        ended = await _done_at(redis, line, [com, *streams])
    assert ended[com] > min(ended[s] for s in streams)  # it waited for a slot to free
    snap = await line.observe()
    assert snap.counters.get("preempted", 0) == 0 and snap.counters["completed"] == 3


async def _all_streamed(redis: Redis, line: Line, rids: list[str]) -> bool:
    return all([await redis.hget(line.keys.request(r), "streamed") == b"1" for r in rids])


async def test_a_full_replica_whose_calls_all_streamed_does_not_poll_the_line(redis: Redis) -> None:
    """Streamed calls are never victims, so once each running call has streamed, no look at the line
    can find a victim until a slot frees: the replica waits for one instead of polling every 20 ms.
    The committed call is not preempted for, and is served once a slot frees."""
    cfg = _cfg(max_preemptions=1)
    line = Line(redis, cfg.namespace, TIER)
    async with _replicas(cfg, redis, 1) as (worker,):
        peeks = 0
        peek = worker.preemptor.line.peek_waiter

        async def counted(*a: object, **kw: object) -> object:
            nonlocal peeks
            peeks += 1
            return await peek(*a, **kw)  # type: ignore[arg-type]

        worker.preemptor.line.peek_waiter = counted  # type: ignore[method-assign]
        bg = []
        for _ in range(2):  # both slots, streamed, ~2 s each
            rid = uuid.uuid4().hex
            await line.enqueue(rid, Priority.background, call_payload("p" * 40, 400, stream=True, ignore_eos=True),
                               60_000)
            bg.append(rid)
        await _until(lambda: _all_streamed(redis, line, bg), "both background calls streaming")
        before = peeks
        t0 = time.monotonic()
        (com,) = await _put(line, Priority.committed, 8)
        ended = await _done_at(redis, line, [com, *bg])
        waited = ended[com] - t0
        assert waited > 0.5, "the committed call waited for a slot (else the check below says nothing)"
        assert peeks == before, f"{peeks - before} looks at the line while nothing running could be preempted"
        assert min(ended[b] for b in bg) <= ended[com]  # served once a slot freed, not by preempting
        assert (await _outcome(redis, line, com))[0] == "completed"
        for b in bg:
            assert (await _outcome(redis, line, b))[0] == "completed"


async def _all_streamed(redis: Redis, line: Line, rids: list[str]) -> bool:
    return all([await redis.hget(line.keys.request(r), "streamed") == b"1" for r in rids])
