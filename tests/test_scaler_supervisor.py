"""The supervisor with real processes and real Redis, but stand-in workers (a tiny Python
loop that never becomes ready, or ignores SIGTERM), to reach the paths a healthy sim worker
never takes: the start timeout, the kill after the drain grace, adoption by a new leader."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from fleet.config import FleetConfig, GpuInventory, TierConfig
from fleet.keys import TierKeys
from scaler.backends import LocalBackend, Supervised
from scaler.placement import Placement, discover
from scaler.supervisor import Supervisor


class StandIn(LocalBackend):
    """Runs `python -c <loop>` instead of a worker; the replica id rides on the command line,
    as it does for a real worker, so adoption by pid can check it."""

    def __init__(self, *, ignore_term: bool = False) -> None:
        super().__init__({})
        self.ignore_term = ignore_term

    def command(self, rec: Supervised) -> list[str]:
        trap = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if self.ignore_term else ""
        return [sys.executable, "-c", f"{trap}import time\nwhile True: time.sleep(0.05)", rec.id]


def config(ns: str) -> FleetConfig:
    return FleetConfig.model_construct(
        namespace=ns, tiers={"planner": TierConfig(gpus_per_replica=2, gpu_memory_gb=70, max_replicas=4)},
        gpus=[GpuInventory(index=i, memory_gb=80) for i in range(4)], heartbeat_s=0.25)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_url)
    yield r
    await r.aclose()


def supervisor(redis: Redis, cfg: FleetConfig, backend: LocalBackend, grace: float = 300.0) -> Supervisor:
    return Supervisor(cfg, redis, backend, Placement(discover(cfg.gpus)[0]), drain_grace_s=grace)


async def until_gone(sup: Supervisor, rid: str | None = None, limit_s: float = 10.0) -> list[str]:
    """Poll until the replica (or every replica) has left; the events it reported meanwhile."""
    def left() -> bool:
        return not sup.records if rid is None else rid not in sup.records

    seen: list[str] = []
    end = time.monotonic() + limit_s
    while not left() and time.monotonic() < end:
        seen += [e.event for e in await sup.poll(set()) if rid is None or e.replica == rid]
        await asyncio.sleep(0.05)
    assert left(), "replicas still running"
    return seen


async def test_placement_start_timeout_and_release(redis: Redis) -> None:
    cfg = config(f"t{uuid.uuid4().hex[:8]}")
    sup = supervisor(redis, cfg, StandIn())
    a, b = await sup.start("planner"), await sup.start("planner")
    assert a is not None and b is not None
    assert len(set(a.gpus) | set(b.gpus)) == 4  # two GPUs each, no GPU shared: 70 + 70 > 80
    assert await sup.start("planner") is None  # nothing fits: the scaler reports capped: gpu_memory
    assert sup.placement.room(2, 70) == 0
    stored = await redis.hgetall(TierKeys(cfg.namespace, "planner").supervised)
    assert {k.decode() for k in stored} == {a.id, b.id}

    # Never ready: past the timeout derived from the expected start-up it is stopped and reported.
    a.launched -= 60
    events = await sup.poll(set(), startup_s=5.0, tier="planner")
    assert [(e.replica, e.event) for e in events] == [(a.id, "start_timeout")]
    assert "not ready after 20 s" in events[0].detail
    # One that turns ready is reported with its measured start-up.
    (ready,) = await sup.poll({b.id}, startup_s=5.0)
    assert ready.event == "ready" and ready.startup_s is not None and b.state == "ready"
    assert await until_gone(sup, a.id) == []  # the stopped one leaves without a second report
    assert sup.placement.room(2, 70) == 1  # its GPUs are free again
    await sup.stop_all(5)
    assert not await redis.hlen(TierKeys(cfg.namespace, "planner").supervised)


async def test_a_replica_that_will_not_drain_is_killed_after_the_grace(redis: Redis) -> None:
    cfg = config(f"t{uuid.uuid4().hex[:8]}")
    sup = supervisor(redis, cfg, StandIn(ignore_term=True), grace=0.5)
    rec = await sup.start("planner")
    assert rec is not None
    await asyncio.sleep(0.3)  # let it install its SIGTERM trap
    assert await sup.drain(rec.id) and not await sup.drain(rec.id)  # once
    await asyncio.sleep(0.2)
    assert sup.backend.alive(rec)  # ignored SIGTERM, still within the grace
    assert await until_gone(sup) == ["killed_after_grace"]


async def test_a_new_leader_adopts_running_replicas_and_drops_dead_records(redis: Redis) -> None:
    cfg = config(f"t{uuid.uuid4().hex[:8]}")
    old = supervisor(redis, cfg, StandIn())
    live = await old.start("planner")
    dead = await old.start("planner")
    assert live is not None and dead is not None
    old.backend.kill(dead)
    old.backend.children[dead.id].wait(5)

    new = supervisor(redis, cfg, StandIn())  # another process would know only Redis
    events = await new.restore()
    assert [(e.replica, e.event) for e in events] == [(dead.id, "lost")]
    assert set(new.records) == {live.id}
    assert new.placement.room(2, 70) == 1  # the adopted replica's GPUs stay booked
    # It can drain what it did not start (by pid, checked against the command line).
    assert await new.drain(live.id)
    old.backend.children[live.id].wait(5)
    assert await until_gone(new) == ["drained"]
    old.backend.cleanup(live)
