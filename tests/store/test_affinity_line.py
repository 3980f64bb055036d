"""Prefix-affine claims on a real Redis and a real Redis Cluster: a replica takes the call of the
chain it served last, without giving up class order, the bounded wait, deadlines or preemption."""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
import pytest

from fleet.config import Priority
from fleet.store.affinity import AffineLine, AffinityRules, cached_prefixes
from fleet.store.connection import connect
from fleet.store.line import Line
from tests.store.conftest import LineSpec

pytestmark = pytest.mark.parametrize("store_url", ["redis", "cluster"], indirect=True)

HOLD_MS = 400  # each class's wait for the replica that holds its prefix, here
RULES = AffinityRules(window=8, wait_ms=(HOLD_MS,) * 4, slack_ms=5000, live_ms=60_000)


@pytest.fixture
def line_spec() -> LineSpec:
    """The shared `line` (tests/store/conftest.py), affine: claims prefer the chain a replica holds."""
    return LineSpec(AffineLine, options={"rules": RULES, "result_ttl_s": 30, "rate_window_s": 5})


async def put(line: Line, prio: Priority, key: str = "", deadline_ms: int = 30_000) -> str:
    rid = uuid.uuid4().hex
    await line.enqueue(rid, prio, orjson.dumps({"k": key}), deadline_ms, affinity=key)
    return rid


async def served(line: Line, replica: str, key: str) -> None:
    """`replica` serves one call of prefix `key` to its end: it holds that prefix now."""
    rid = await put(line, Priority.interactive, key)
    [c] = await line.claim(replica, 1, 5)
    assert c.rid == rid
    assert await line.finish(rid, "completed", owner=c.owner) == "running"


async def test_a_replica_takes_its_chain_ahead_of_an_older_call_of_the_class(line: AffineLine) -> None:
    await served(line, "a", "chain-1")
    older = await put(line, Priority.interactive, "chain-2")
    turn = await put(line, Priority.interactive, "chain-1")
    [c] = await line.claim("a", 1, 5)
    assert c.rid == turn  # its cache has chain-1: the younger call of the same class goes first
    [d] = await line.claim("b", 1, 5)
    assert d.rid == older  # the older one, held by no one, is the next replica's
    assert await cached_prefixes(line.redis, line.keys) == {"a": 1, "b": 1}


async def test_another_replica_leaves_the_call_to_its_holder_and_rings_it(line: AffineLine) -> None:
    await served(line, "a", "chain-1")
    turn = await put(line, Priority.interactive, "chain-1")
    got = await line.claim("b", 4, 5)
    assert list(got) == [] and not got.more and 0 < got.retry_s <= HOLD_MS / 1000
    # The holder, waiting on the bell, is woken on its own key and takes it at once.
    assert await line.redis.llen(line.keys.wake("a")) == 1
    took = await line.wait_and_claim("a", 4, 5, timeout_s=5, wake=line.keys.wake("a"))
    assert [c.rid for c in took] == [turn]


async def test_any_replica_takes_the_call_after_the_bounded_wait(line: AffineLine) -> None:
    await served(line, "a", "chain-1")
    turn = await put(line, Priority.interactive, "chain-1")
    t0 = time.monotonic()
    got = await line.claim("b", 1, 5)
    while not got:  # "a" never comes: "b" retries when told, and takes it once the hold is over
        await asyncio.sleep(got.retry_s)
        got = await line.claim("b", 1, 5)
    assert got[0].rid == turn
    assert HOLD_MS / 1000 * 0.9 <= time.monotonic() - t0 < 5


async def test_a_held_call_never_lets_a_lower_class_go_first(line: AffineLine) -> None:
    await served(line, "a", "chain-1")
    high = await put(line, Priority.interactive, "chain-1")
    low = await put(line, Priority.background)
    got = await line.claim("b", 4, 5)
    assert list(got) == []  # the interactive call waits for "a": nothing below it goes ahead
    got = await line.claim("a", 4, 5)
    assert [c.rid for c in got] == [high, low]


async def test_its_own_chain_never_goes_ahead_of_a_higher_class(line: AffineLine) -> None:
    await served(line, "a", "chain-1")
    mine = await put(line, Priority.background, "chain-1")
    committed = await put(line, Priority.committed, "chain-2")
    got = await line.claim("a", 1, 5)
    assert [c.rid for c in got] == [committed]
    assert [c.rid for c in await line.claim("a", 1, 5)] == [mine]


async def test_a_call_near_its_deadline_is_neither_passed_over_nor_held(line: AffineLine) -> None:
    await served(line, "a", "chain-1")
    await served(line, "b", "chain-2")
    urgent = await put(line, Priority.interactive, "chain-2", deadline_ms=4000)  # under the 5 s slack
    mine = await put(line, Priority.interactive, "chain-1")
    # "a" holds chain-1 but the urgent call is ahead of it; it is held by "b", but has no time to wait.
    assert [c.rid for c in await line.claim("a", 1, 5)] == [urgent]
    assert [c.rid for c in await line.claim("a", 1, 5)] == [mine]


async def test_a_call_a_replica_preempted_for_is_taken_first(line: AffineLine) -> None:
    await served(line, "a", "chain-1")
    await served(line, "b", "chain-2")
    running = await put(line, Priority.background)
    [victim] = await line.claim("c", 1, 5)
    assert victim.rid == running
    waiter = await put(line, Priority.interactive, "chain-2")  # held by "b", which is busy
    mine = await put(line, Priority.interactive, "chain-1")
    assert await line.preempt(waiter, victim.rid, victim.owner, max_preemptions=1)
    # "a" made room for the waiter: it takes it, not its own chain behind it, and does not wait for "b".
    assert [c.rid for c in await line.claim("a", 1, 5)] == [waiter]
    assert [c.rid for c in await line.claim("a", 1, 5)] == [mine]


async def test_a_gone_replica_holds_nothing(store_url: str) -> None:
    r = connect(store_url)
    try:
        line = AffineLine(r, f"t{uuid.uuid4().hex[:8]}", "routing", result_ttl_s=30,
                          rules=AffinityRules(window=8, wait_ms=(60_000,) * 4, slack_ms=0, live_ms=300))
        await served(line, "a", "chain-1")
        turn = await put(line, Priority.interactive, "chain-1")
        got = await line.claim("b", 1, 5)
        while not got:  # "a" ran no claim for longer than `live_ms`: it is gone, so its call is anyone's
            await asyncio.sleep(0.1)
            got = await line.claim("b", 1, 5)
        assert got[0].rid == turn and got[0].waited_ms < 5_000  # far sooner than its 60 s hold
    finally:
        await r.aclose()


async def test_expired_calls_end_on_the_way_as_in_the_plain_claim(line: AffineLine) -> None:
    gone = await put(line, Priority.interactive, "chain-1", deadline_ms=1)
    live = await put(line, Priority.interactive)
    await asyncio.sleep(0.01)
    assert [c.rid for c in await line.claim("a", 2, 5)] == [live]
    assert await line.outcome(gone) == "expired"
    assert (await line.observe()).counters.get("expired") == 1
