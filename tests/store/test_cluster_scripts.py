"""On a real Redis Cluster, no processes: a script reaching outside its tier's slot fails, the URL
scheme takes seeds and names bad ones, and a transaction that met a dead node does not wedge the
client. A master killed under load: tests/processes/test_cluster_line.py."""

from __future__ import annotations

import uuid

import pytest
import redis

from fleet.store.connection import connect, connect_sync, parse_url
from fleet.store.keys import TierKeys
from fleet.store.lua import CLOCK


async def test_a_script_reaching_outside_its_tiers_slot_fails_on_the_cluster(redis_cluster_url: str) -> None:
    r = connect(redis_cluster_url)
    mine, other = TierKeys("slotcheck", "routing"), TierKeys("slotcheck", "planner")
    assert await r.cluster_keyslot(mine.line) != await r.cluster_keyslot(other.line)  # type: ignore[attr-defined]
    inside = r.register_script(CLOCK + "redis.call('HSET', ARGV[1] .. 'req:x', 'enq', n2s(now)) return 1")
    assert await inside(keys=[mine.line], args=[mine.request("")[:-4]]) == 1
    outside = r.register_script(CLOCK + "redis.call('HSET', ARGV[1] .. 'req:x', 'enq', n2s(now)) return 1")
    with pytest.raises(redis.ResponseError, match="same slot"):
        await outside(keys=[mine.line], args=[other.request("")[:-4]])
    await r.aclose()


def test_the_cluster_scheme_takes_seeds_and_names_bad_ones(redis_cluster_url: str) -> None:
    assert parse_url(redis_cluster_url).scheme == "redis+cluster"
    r = connect_sync(redis_cluster_url)
    assert r.ping()
    with pytest.raises(ValueError, match="HOST:PORT"):
        connect_sync("redis+cluster://127.0.0.1")


async def test_a_transaction_that_met_a_dead_node_does_not_wedge_the_client(redis_cluster_url: str) -> None:
    """redis-py 6.4's transaction pipeline, on a connection error, files that error as the slot
    map's pending MOVED redirect (`update_moved_exception`, what `_reinitialize_on_error` calls);
    every later command then failed reading its host. A CI rehearsal's gateway stayed wedged a
    minute after a promotion. The fleet's client drops it and carries on."""
    client = connect(redis_cluster_url, name="test")
    try:
        key = f"{{wedge}}:{uuid.uuid4().hex}"
        await client.set(key, "1")
        client.nodes_manager.update_moved_exception(redis.exceptions.ConnectionError("closed"))  # type: ignore[attr-defined]
        assert await client.get(key) == b"1"  # a command carries on...
        client.nodes_manager.update_moved_exception(redis.exceptions.ConnectionError("closed"))  # type: ignore[attr-defined]
        async with client.pipeline(transaction=True) as p:  # ...and so does a transaction
            p.incr(key).get(key)
            assert await p.execute() == [2, b"2"]
        await client.delete(key)
    finally:
        await client.aclose()
