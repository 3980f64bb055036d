"""The one connection factory: timeouts fitted to each role, retries on connection errors only,
a frozen Redis that becomes a typed error instead of a hang, and a clear error for a URL scheme
it does not know (where Redis Cluster will plug in)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fleet.redis_server import PrivateRedis, answers
from fleet.store.connection import MAX_BLOCK_S, ROLE_TIMEOUTS, Clients, connect, connect_sync, parse_url


def test_each_role_gets_timeouts_that_fit_it() -> None:
    calls, blocking, pubsub = (ROLE_TIMEOUTS[r] for r in ("calls", "blocking", "pubsub"))
    assert calls.read_s is not None and calls.read_s <= 5 and calls.connect_s <= 2
    assert blocking.read_s is not None and blocking.read_s > MAX_BLOCK_S  # a block that ran out is not a dead server
    assert pubsub.read_s is None and pubsub.health_check_s > 0  # subscriptions wait; a PING finds a dead link
    kw = connect("redis://127.0.0.1:1/0", "calls").connection_pool.connection_kwargs
    assert kw["socket_timeout"] == calls.read_s and kw["socket_connect_timeout"] == calls.connect_s
    assert kw["health_check_interval"] == calls.health_check_s
    retry = kw["retry"]
    assert RedisConnectionError in retry._supported_errors and RedisTimeoutError not in retry._supported_errors


def test_unknown_schemes_are_refused_by_name() -> None:
    assert parse_url("redis://h:6379/0").scheme == "redis"
    assert parse_url("unix:///tmp/r.sock").scheme == "unix"
    assert parse_url("redis+cluster://127.0.0.1:7000").scheme == "redis+cluster"
    with pytest.raises(ValueError, match=r"unsupported scheme 'memcached'.*redis://"):
        connect("memcached://127.0.0.1:11211")
    with pytest.raises(ValueError, match="unsupported scheme"):
        parse_url("127.0.0.1:6379")


def test_nothing_listening_is_a_quick_no() -> None:
    t0 = time.monotonic()
    assert not answers("redis://127.0.0.1:1/0", 0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(RedisConnectionError):
        connect_sync("redis://127.0.0.1:1/0", retries=0).ping()


async def test_a_frozen_redis_is_a_timeout_not_a_hang_and_blocking_reads_outlast_their_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The calls' read timeout shortened for this test (the roles' own values are checked above):
    # what is tested is that a frozen server ends in that timeout, whatever its length.
    read_s = 0.5
    monkeypatch.setitem(ROLE_TIMEOUTS, "calls", dataclasses.replace(ROLE_TIMEOUTS["calls"], read_s=read_s))
    own = PrivateRedis().start()
    clients = Clients.open(own.url, name="test")
    try:
        assert await clients.calls.ping()
        t0 = time.monotonic()
        # A block that runs its course (longer than the calls' timeout) returns empty: no timeout
        # on the blocking client.
        assert await clients.blocking.blpop(["nothing-here"], timeout=0.8) is None
        assert 0.75 <= time.monotonic() - t0 < MAX_BLOCK_S
        assert own.proc is not None
        os.kill(own.proc.pid, signal.SIGSTOP)  # frozen: accepts nothing, answers nothing
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await asyncio.wait_for(clients.calls.get("x"), 30)
            took = time.monotonic() - t0
            assert 0.9 * read_s <= took < read_s + 3  # the read timeout ended it, not the 30 s outer limit
        finally:
            os.kill(own.proc.pid, signal.SIGCONT)
        assert await clients.calls.ping()  # and it comes back
    finally:
        await clients.aclose()
        own.stop()


async def test_commands_are_packed_by_hiredis_with_the_same_bytes_and_refusals(redis_url: str) -> None:
    """The factory's asyncio clients pack in C (fleet.store.packing): the same RESP bytes redis-py
    packs, so every command reads back what was written, and what redis-py refuses is refused alike."""
    from redis.asyncio.connection import Connection
    from redis.exceptions import DataError

    from fleet.store.packing import HiredisPack

    for wait in (None, 1.0):  # the plain pool and the bounded one
        client = connect(redis_url, max_connections=4, wait_for_connection_s=wait)
        pool = client.connection_pool
        assert issubclass(pool.connection_class, HiredisPack)
        conn = pool.make_connection()
        args = ("XADD", b"k", "*", "n", 7, "f", 1.5, "s", "ünïcode", b"b", memoryview(b"mv"))
        assert b"".join(conn.pack_command(*args)) == b"".join(Connection.pack_command(conn, *args))
        assert conn.pack_command("CLIENT SETNAME", "x") == Connection.pack_command(conn, "CLIENT SETNAME", "x")
        try:
            await client.set("packing:k", "ünïcode")
            assert (await client.get("packing:k")).decode() == "ünïcode"
            await client.hset("packing:h", mapping={"i": 3, "f": 0.25})
            assert await client.hmget("packing:h", ["i", "f"]) == [b"3", b"0.25"]
            for bad in (True, None, {"a": 1}):
                with pytest.raises(DataError):
                    await client.set("packing:bad", bad)  # type: ignore[arg-type]
            assert await client.get("packing:bad") is None
        finally:
            await client.delete("packing:k", "packing:h")
            await client.aclose()
