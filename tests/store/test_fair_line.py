"""The fair line on a real Redis (and a Redis Cluster): within a class, least attained service per
flow; class order, a flow's own order and preemption's places as before; the Lua's start tags
are the policy's (`fleet.policy.fairness`)."""

from __future__ import annotations

import uuid

import pytest

from fleet.config import Priority
from fleet.policy.fairness import call_cost, class_clock, flow_start
from fleet.store.flows import Place, read_clock, read_flow
from fleet.store.line import Line

pytestmark = pytest.mark.parametrize("store_url", ["redis", "cluster"], indirect=True)

COST = 100


async def put(line: Line, flow: str, n: int = 1, prio: Priority = Priority.interactive, *, cost: int = COST,
              fair: bool = True) -> list[str]:
    ids = []
    for _ in range(n):
        rid = uuid.uuid4().hex
        await line.enqueue(rid, prio, b"{}", 30_000, place=Place(flow, cost, 60.0) if fair else None)
        ids.append(rid)
    return ids


async def claim_all(line: Line) -> list[str]:
    return [c.rid for c in await line.claim("w", 1000, 5)]


async def test_a_quiet_flow_is_not_put_behind_a_flood(line: Line) -> None:
    flood = await put(line, "key:flood", 30)
    quiet = await put(line, "key:quiet", 3)
    order = await claim_all(line)
    # Each quiet call waits behind about one flood call, not behind thirty.
    assert max(order.index(q) for q in quiet) <= 6
    assert [r for r in order if r in flood] == flood  # the flood keeps its own order


async def test_fifo_keeps_arrival_order(line: Line) -> None:
    flood = await put(line, "key:flood", 10, fair=False)
    quiet = await put(line, "key:quiet", 2, fair=False)
    assert await claim_all(line) == flood + quiet


async def test_a_class_never_overtakes_a_higher_one(line: Line) -> None:
    bg = await put(line, "key:new", 2, Priority.background)
    flood = await put(line, "key:flood", 20, Priority.interactive)
    order = await claim_all(line)
    assert order == flood + bg  # however served the interactive flood, it goes first


async def test_a_new_flow_starts_level_not_at_zero(line: Line) -> None:
    a = await put(line, "chain:a", 10)
    b = await put(line, "chain:b", 10)
    first = await line.claim("w", 8, 5)  # a and b alternate: each was served ~4
    assert {c.rid for c in first} <= set(a[:5] + b[:5])
    (late,) = await put(line, "chain:late")
    score = [float(await line.redis.hget(line.keys.request(r), "score")) for r in (late, *(c.rid for c in first))]
    assert score[0] > max(score[1:])  # not at zero: what was served already stays behind it
    order = await claim_all(line)
    assert order.index(late) <= 2  # level with the head: it does not wait behind a's and b's backlog


async def test_the_scripts_tag_is_the_policys(line: Line) -> None:
    """The start tag ENQUEUE gives equals `fleet.policy.fairness.flow_start` on what Redis held."""
    await put(line, "chain:heavy", 6)
    await claim_all(line)  # heavy was served; the class is empty
    await put(line, "chain:other")
    for flow in ("chain:heavy", "chain:other", "chain:new"):
        k = line.keys
        rec = await read_flow(line.redis, k, 1, flow)
        head = await line.redis.zrangebyscore(k.line, 1e15, 2e15 - 1, start=0, num=1, withscores=True)
        v = class_clock((await read_clock(line.redis, k)).get(1, 0.0), head[0][1] - 1e15 if head else None)
        backlogged = rec is not None and await line.redis.zscore(k.line, rec.last) is not None
        now_ms = int((await line.redis.time())[0]) * 1000
        want = flow_start(v, rec, backlogged=backlogged, now_ms=now_ms, half_life_s=60.0)
        (rid,) = await put(line, flow)
        score = float(await line.redis.hget(k.request(rid), "score")) - 1e15
        assert abs(score - want) <= 1  # the same rule (the clocks differ by the ms between the reads)
    got = await read_flow(line.redis, line.keys, 1, "chain:heavy")
    assert got is not None and got.tag > v  # served more than the clock: it still owes


async def test_a_heavy_flow_goes_after_one_that_was_not_served(line: Line) -> None:
    await put(line, "chain:heavy", 8)
    await claim_all(line)
    light = await put(line, "chain:light", 3)
    heavy = await put(line, "chain:heavy", 2)
    assert await claim_all(line) == light + heavy  # heavy was served ~8 calls more: it waits its turn


async def test_the_key_weight_shares_the_class(line: Line) -> None:
    one = await put(line, "key:one", 30, cost=call_cost(50, 25, output_weight=2.0, weight=1.0))
    await put(line, "key:two", 30, cost=call_cost(50, 25, output_weight=2.0, weight=2.0))
    first = [c.rid for c in await line.claim("w", 30, 5)]
    of_one = sum(r in one for r in first)
    assert 9 <= of_one <= 11  # a key of weight 2 is served twice as much while both wait


async def test_preempted_call_keeps_its_place(line: Line) -> None:
    a = await put(line, "chain:a", 3)
    running = await line.claim("w", 1, 5)
    assert running[0].rid == a[0]
    (com,) = await put(line, "chain:c", 1, Priority.committed)
    assert await line.preempt(com, a[0], running[0].owner, max_preemptions=2)
    b = await put(line, "chain:b", 2)
    order = await claim_all(line)
    assert order[0] == com and order[1] == a[0]  # back at the head of its class, ahead of newcomers
    assert [r for r in order if r in a] == a and set(b) <= set(order)


async def test_admission_sees_the_fair_order(line: Line) -> None:
    """A flooding flow is refused for its own backlog (its Retry-After from its own wait); a quiet
    flow of the same class, asking at the same instant, is admitted."""
    from fleet.policy import ServiceForecast, admit
    from fleet.policy.fairness import fair_line
    from fleet.store.admitting import Admitting

    await put(line, "key:flood", 40)
    adm = Admitting(line.redis)
    forecast = ServiceForecast(rate=10.0, delay_s=0.0, basis="measured")
    seen = {}
    for flow in ("key:flood", "key:quiet"):
        snap = await adm.observe_and_mark(line.keys, line.prefix, f"1:{flow}", 5000, (1, Place(flow, COST, 60.0)))
        assert snap.ahead_in_class is not None
        ahead = sum(fair_line(snap.line, Priority.interactive, snap.ahead_in_class)[:2])
        seen[flow] = admit(Priority.interactive, ahead=ahead, forecast=forecast, service_s=0.2, wait_limit_s=2.0,
                           deadline_s=None)
    assert seen["key:flood"].ahead == 40 and seen["key:flood"].reason == "drain_exceeded"
    assert seen["key:flood"].retry_after_s >= 2  # its own 40 ahead at 10/s, less the 2 s limit
    assert seen["key:quiet"].admitted and seen["key:quiet"].ahead <= 1
    # In a fifo tier (no place) the whole class is ahead of everyone.
    snap = await adm.observe_and_mark(line.keys, line.prefix, "1:x", 5000)
    assert snap.ahead_in_class is None and snap.waiting[1] == 40
