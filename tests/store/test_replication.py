"""Enqueues a replica acknowledged (issue 24): on a Redis with a replica, a call's enqueue returns
only once the replica has it (`WAIT 1`), bounded by `replication.ack_timeout_ms`; on one without,
nothing waits. A real master and replica (`redis-server --replicaof`), nothing mocked."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from fleet.config import Priority, load_config
from fleet.redis_server import PrivateRedis
from fleet.store.line import Line
from fleet.store.replication import Ack
from tests.harness import TEST_CONFIG, call_payload, wait_until

ACK = Ack(replicas=1, timeout_ms=300)
# Where a test needs the acknowledgement itself, not its timeout: a loaded CI box has taken over
# 300 ms to answer a WAIT (a replica waiting for a core), which fell short and read as a loss.
PATIENT = Ack(replicas=1, timeout_ms=5000)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[PrivateRedis, PrivateRedis]]:
    """A master and its replica, in sync."""
    master = PrivateRedis().start()
    # The replica's first sync at once, not after the 5 s a master waits by default for more
    # replicas to share one diskless transfer (there is one replica here).
    with sync_redis.Redis(port=master.port) as m:
        m.config_set("repl-diskless-sync-delay", 0)
    replica = PrivateRedis(replica_of=master.port).start()
    try:
        r = sync_redis.Redis(port=replica.port)
        wait_until(lambda: r.info("replication").get("master_link_status") == "up", 20, what="replica in sync")
        # And the master's own view: the line counts the master's online replicas to decide whether
        # to WAIT, and a replica's link can be up a moment before its master lists it online.
        m = sync_redis.Redis(port=master.port)

        def online() -> bool:
            info = m.info("replication")
            return info.get("connected_slaves") == 1 and info.get("slave0", {}).get("state") == "online"

        wait_until(online, 20, what="the master listing its replica online")
        m.close()
        yield master, replica
    finally:
        replica.stop()
        master.stop()


@pytest.fixture
def line_url(pair: tuple[PrivateRedis, PrivateRedis]) -> str:
    """The shared `line` (tests/store/conftest.py) on this module's master."""
    return pair[0].url


async def _enqueue(line: Line, ack: Ack | None) -> tuple[str, float]:
    rid = uuid.uuid4().hex
    t0 = time.monotonic()
    await line.enqueue(rid, Priority.committed, call_payload("x"), 30_000, ack=ack)
    return rid, time.monotonic() - t0


async def test_an_acknowledged_enqueue_is_on_the_replica_when_it_returns(line: Line, pair) -> None:  # type: ignore[no-untyped-def]
    replica = sync_redis.Redis(port=pair[1].port)
    for _ in range(50):
        rid, _ = await _enqueue(line, PATIENT)
        assert replica.hget(line.keys.request(rid), "state") == b"queued"  # read at once, no retry
    assert await line.replicas.known() == 1 and line.replicas.short == 0


async def test_a_silent_replica_costs_one_timeout_then_the_call_goes_on_and_is_counted(line: Line, pair) -> None:  # type: ignore[no-untyped-def]
    await _enqueue(line, PATIENT)  # the replica count is known from here
    short_before = line.replicas.short
    proc = pair[1].proc
    proc.send_signal(signal.SIGSTOP)
    try:
        rid, took = await _enqueue(line, ACK)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert ACK.timeout_ms / 1000 * 0.9 <= took < ACK.timeout_ms / 1000 + 1.0, took
    assert line.replicas.short == short_before + 1
    assert await line.redis.hget(line.keys.request(rid), "state") == b"queued"  # accepted all the same


async def test_without_replicas_nothing_waits(redis_url: str) -> None:
    r = Redis.from_url(redis_url)
    try:
        line = Line(r, f"t{uuid.uuid4().hex[:8]}", "routing")
        await _enqueue(line, ACK)
        assert await line.replicas.known() == 0
        took = [(await _enqueue(line, ACK))[1] for _ in range(20)]
        assert max(took) < ACK.timeout_ms / 1000 / 2, took  # no WAIT, so no timeout paid
    finally:
        await r.aclose()


def test_every_class_waits_by_default_and_the_config_can_name_fewer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(TEST_CONFIG)
    assert all(cfg.replication.waits(c) for c in ("committed", "interactive", "speculative", "background"))
    p = tmp_path / "fleet.yaml"
    p.write_text(TEST_CONFIG.read_text() + "\nreplication: {ack_classes: [committed]}\n")
    named = load_config(p).replication
    assert named.waits("committed") and not named.waits("background")
    p.write_text(TEST_CONFIG.read_text() + "\nreplication: {ack_classes: [urgent]}\n")
    with pytest.raises(Exception, match=r"replication\.ack_classes"):
        load_config(p)


async def test_the_ack_waits_on_the_cluster_too(redis_cluster_url: str) -> None:
    """On a cluster the WAIT goes to the master of the tier's slot, with the enqueue: what it
    acknowledged is on that master's replica (read there, READONLY) when the enqueue returns."""
    from fleet.store.connection import connect

    r = connect(redis_cluster_url)
    try:
        line = Line(r, f"t{uuid.uuid4().hex[:8]}", "routing")
        ack = Ack(replicas=1, timeout_ms=2000)  # a loaded box may lag; an acknowledgement is what counts here
        await line.replicas.known()
        replica = _replica_of(r.get_node_from_key(line.keys.line))
        replica.execute_command("READONLY")
        for _ in range(10):
            rid, _ = await _enqueue(line, ack)
            assert replica.hget(line.keys.request(rid), "state") == b"queued"
        assert line.replicas.count == 1 and line.replicas.short == 0
    finally:
        await r.aclose()


def _replica_of(master) -> sync_redis.Redis:  # type: ignore[no-untyped-def]
    """A client of the replica of cluster node `master`, found in CLUSTER NODES."""
    c = sync_redis.Redis(host=master.host, port=master.port, decode_responses=True)
    rows = [ln.split() for ln in c.execute_command("CLUSTER", "NODES").splitlines()]
    me = next(row[0] for row in rows if "myself" in row[2])
    addr = next(row[1] for row in rows if row[3] == me and "slave" in row[2])
    host, port = addr.split("@")[0].rsplit(":", 1)
    return sync_redis.Redis(host=host, port=int(port))
