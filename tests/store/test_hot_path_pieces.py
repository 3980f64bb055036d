"""The pieces the hot path relies on, one by one, on a real Redis: the claim's `more`, a wait that
claims when the bell rings, a ring that ends a wait at once, and a token charge pipelined with
another write (exact even when Redis lost its scripts). What a whole call costs in round trips is
counted with the parts as processes (tests/processes/test_hot_path.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fleet.config import Priority, load_config
from fleet.redis_server import PrivateRedis
from fleet.store.connection import connect
from fleet.store.keys import TierKeys
from fleet.store.ledger import Ledger
from fleet.store.line import Line
from fleet.store.version_outcomes import queue_outcome, read_outcomes
from tests.harness import TEST_CONFIG, blocked_in


async def test_claim_says_whether_more_is_claimable(line: Line) -> None:
    for _ in range(3):
        await line.enqueue(uuid.uuid4().hex, Priority.interactive, b"{}", 60_000)
    first = await line.claim("w", 2, 5)
    assert len(first) == 2 and first.more  # stopped at n: there may be more
    rest = await line.claim("w", 5, 5)
    assert len(rest) == 1 and not rest.more  # emptied the line
    assert not (await line.claim("w", 5, 5)).more and await line.claim("w", 5, 5) == []


async def test_wait_and_claim_claims_when_the_bell_rings(line: Line) -> None:
    wait = asyncio.ensure_future(line.wait_and_claim("w", 4, 5, timeout_s=5.0))
    await blocked_in(line.redis, line.keys.namespace, "blpop")  # blocked on the bell
    assert not wait.done()
    rid = uuid.uuid4().hex
    t0 = time.monotonic()
    await line.enqueue(rid, Priority.interactive, b'{"x": 1}', 60_000)
    got = await asyncio.wait_for(wait, 3)
    assert [c.rid for c in got] == [rid] and got[0].payload == b'{"x": 1}' and not got.more
    assert time.monotonic() - t0 < 2.0  # claimed on the ring, not at the 5 s timeout
    assert await line.redis.zscore(line.keys.inflight, rid) is not None  # leased like any claim


async def test_a_ring_ends_the_wait_at_once(line: Line) -> None:
    wake = line.keys.wake("w")
    wait = asyncio.ensure_future(line.wait_and_claim("w", 4, 5, timeout_s=5.0, wake=wake))
    await blocked_in(line.redis, line.keys.namespace, "blpop")
    t0 = time.monotonic()
    await line.ring(wake)
    got = await asyncio.wait_for(wait, 3)
    assert got == [] and time.monotonic() - t0 < 2.0


async def test_a_charge_pipelined_with_another_write_is_exact_even_without_its_script() -> None:
    own = PrivateRedis().start()  # its scripts are flushed: a Redis of its own, not the session's
    r = connect(own.url)
    try:
        cfg = load_config(TEST_CONFIG)
        tier = next(iter(cfg.tiers))
        ns = f"t{uuid.uuid4().hex[:8]}"
        lg, keys = Ledger(r, ns, tier, cfg.tiers[tier]), TierKeys(ns, tier)
        await lg.record_tokens("k", "interactive", 10, 5, useful=True,
                               also=lambda p: queue_outcome(p, keys, "v1", True, 0.1))
        await r.script_flush()  # Redis lost its scripts (a restart): the charge must still land, once
        await lg.record_tokens("k", "interactive", 10, 5, useful=True,
                               also=lambda p: queue_outcome(p, keys, "v1", True, 0.1))
        await lg.record_tokens("k", "interactive", 0, 0, useful=False,  # nothing to charge: the write still goes
                               also=lambda p: queue_outcome(p, keys, "v1", False, 0.0))
        total = await lg.totals()
        assert total.tokens == 30 and total.completion_tokens == 10 and total.useful_tokens == 10
        assert (await lg.tokens_by_key())[("k", "interactive")] == {"pt": 20, "ct": 10, "ut": 10}
        outcomes, _ = await read_outcomes(r, keys, since_s=0)
        assert [o.ok for o in outcomes] == [True, True, False]
    finally:
        await r.aclose()
        own.stop()
