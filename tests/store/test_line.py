"""The line protocol on a real Redis: class order, FIFO, leases, requeue, outcomes."""

from __future__ import annotations

import asyncio

import pytest

from fleet.config import Priority
from fleet.store.connection import pubsub_source
from fleet.store.events import Done, decode
from fleet.store.line import Line
from tests.harness import enqueue_many as _put

DONE = Done(1, "stop", {})

# The line protocol runs the same on one Redis and on a Redis Cluster (3 masters + 3 replicas).
pytestmark = pytest.mark.parametrize("store_url", ["redis", "cluster"], indirect=True)



async def test_committed_overtakes_fifty_background(line: Line) -> None:
    bg = await _put(line, Priority.background, 50)
    (committed,) = await _put(line, Priority.committed)
    first = await line.claim("w1", 1, 5)
    assert first[0].rid == committed
    rest = await line.claim("w1", 100, 5)
    assert [c.rid for c in rest] == bg  # FIFO within the class


async def test_strict_class_order_then_fifo(line: Line) -> None:
    order = [Priority.background, Priority.speculative, Priority.interactive, Priority.committed] * 3
    ids = {p: [] for p in Priority}
    for p in order:
        ids[p] += await _put(line, p)
    claimed = [c.rid for c in await line.claim("w", 100, 5)]
    assert claimed == ids[Priority.committed] + ids[Priority.interactive] + ids[Priority.speculative] + ids[
        Priority.background]


async def test_expired_lease_requeues_at_head_of_class(line: Line) -> None:
    a, b = await _put(line, Priority.interactive, 2)
    [ca] = await line.claim("dead-worker", 1, lease_s=0.05)
    assert ca.rid == a
    await asyncio.sleep(0.1)
    assert await line.reap() == (1, 0, 0)
    again = await line.claim("w2", 2, 5)
    assert [c.rid for c in again] == [a, b]  # back ahead of what arrived after it
    assert again[0].attempt == 2 and again[0].owner == "w2:2"
    # The dead worker's late completion is refused: exactly once.
    assert not await line.finish(a, "completed", DONE, owner=ca.owner)
    assert await line.finish(a, "completed", DONE, owner=again[0].owner) == "running"
    snap = await line.observe()
    assert snap.counters["completed"] == 1 and snap.counters["requeued"] == 1


async def test_renewed_lease_is_not_reaped(line: Line) -> None:
    [rid] = await _put(line, Priority.committed)
    [c] = await line.claim("w", 1, lease_s=0.3)
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await line.renew([(rid, c.owner)], 0.3) == []
        assert await line.reap() == (0, 0, 0)
    assert await line.renew([(rid, "other:1")], 0.3) == [rid]  # not its lease


async def test_streamed_request_is_not_rerun_but_lost(line: Line) -> None:
    [rid] = await _put(line, Priority.interactive)
    [c] = await line.claim("w", 1, lease_s=0.05)
    chunk = b'"delta":{"content":"hello"},"logprobs":null'
    assert await line.emit([(rid, c.owner, chunk, True, "")]) == []  # all written
    await asyncio.sleep(0.1)
    assert await line.reap() == (0, 1, 0)
    entries = await line.redis.xrange(line.keys.result(rid))
    assert [decode(e[1]).type for e in entries[1:]] == ["worker_lost"]
    assert await line.claim("w2", 5, 5) == []


async def test_deadline_passed_in_line_never_claimed(line: Line) -> None:
    [late] = await _put(line, Priority.committed, deadline_ms=20)
    [ok] = await _put(line, Priority.background)
    await asyncio.sleep(0.05)
    claimed = await line.claim("w", 5, 5)
    assert [c.rid for c in claimed] == [ok]
    [(_, fields)] = await line.redis.xrange(line.keys.result(late))
    assert decode(fields).type == "deadline_exceeded"
    assert (await line.observe()).counters["expired"] == 1


async def test_every_accepted_request_has_exactly_one_outcome(line: Line) -> None:
    ids = await _put(line, Priority.interactive, 8)
    claimed = await line.claim("w", 4, 5)
    for c in claimed[:2]:
        assert await line.finish(c.rid, "completed", owner=c.owner)
    assert await line.finish(claimed[2].rid, "cancelled") == "running"  # an engine had it
    assert await line.finish(claimed[3].rid, "failed", owner=claimed[3].owner)
    assert await line.finish(ids[4], "cancelled") == "queued"  # still in the line: no engine saw it
    assert await line.finish(ids[5], "expired")
    for rid in ids[:6]:  # second endings are refused
        assert not await line.finish(rid, "completed")
    c = (await line.observe()).counters
    assert c["accepted"] == 8
    assert sum(c.get(k, 0) for k in ("completed", "expired", "cancelled", "failed")) == 6
    assert (await line.observe()).waiting == 2


async def test_cancel_of_running_request_reaches_its_worker(line: Line) -> None:
    [rid] = await _put(line, Priority.interactive)
    await line.claim("w", 1, 5)
    pubsub = pubsub_source(line.redis).pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(line.keys.cancel_channel)
    await line.finish(rid, "cancelled")
    msg = None
    for _ in range(20):  # the first reads may be the (ignored) subscribe confirmation
        msg = msg or await pubsub.get_message(timeout=0.1)
    assert msg and msg["data"] == rid.encode()
    await pubsub.aclose()


async def test_a_request_whose_hash_expired_in_the_line_still_gets_its_outcome(line: Line) -> None:
    [rid] = await _put(line, Priority.interactive)
    await line.redis.delete(line.keys.request(rid))  # as its TTL would, the gateway long gone
    assert await line.claim("w", 5, 5) == []
    c = (await line.observe()).counters
    assert c["accepted"] == 1 and c["expired"] == 1


async def test_all_keys_of_a_tier_share_one_hash_tag(line: Line) -> None:
    k = line.keys
    names = [k.line, k.inflight, k.seq, k.bell, k.counters, k.arrivals, k.completions, k.replicas, k.dead,
             k.request("x"), k.result("x")]
    assert {n[n.index("{"): n.index("}") + 1] for n in names} == {"{routing}"}


async def test_a_running_request_whose_hash_expired_is_counted_when_reaped(line: Line) -> None:
    """Its gateway and its worker both vanished and its hash ran out: the reaper finds only the
    lease. It is counted expired, as CLAIM counts the same case, so every accepted request still
    has exactly one outcome."""
    [rid] = await _put(line, Priority.interactive)
    [c] = await line.claim("gone-worker", 1, lease_s=0.05)
    await line.redis.delete(line.keys.request(c.rid))  # as its TTL would
    reaped = None
    for _ in range(200):  # until the lease has run out (50 ms) and the reaper took it
        reaped = await line.reap()
        if reaped != (0, 0, 0):
            break
        await asyncio.sleep(0.01)
    assert reaped == (0, 0, 1)
    assert await line.redis.zcard(line.keys.inflight) == 0
    counters = (await line.observe()).counters
    assert counters["accepted"] == 1 == counters["expired"]
    assert counters["accepted"] == sum(counters.get(k, 0) for k in ("completed", "expired", "cancelled", "failed"))
    assert rid == c.rid
