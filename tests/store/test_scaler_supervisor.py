"""The supervisor with real processes and real Redis, but stand-in workers (a tiny Python
loop that never becomes ready, or ignores SIGTERM), to reach the paths a healthy sim worker
never takes: the start timeout, the kill after the drain grace, adoption by a new leader."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from fleet.config import FleetConfig, GpuInventory, TierConfig
from fleet.policy import ScaleDecision, wedged
from fleet.store.keys import TierKeys
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


def config(ns: str, heartbeat_s: float = 0.25) -> FleetConfig:
    return FleetConfig.model_construct(
        namespace=ns, tiers={"planner": TierConfig(gpus_per_replica=2, gpu_memory_gb=70, max_replicas=4)},
        gpus=[GpuInventory(index=i, memory_gb=80) for i in range(4)], heartbeat_s=heartbeat_s)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_url)
    yield r
    await r.aclose()


def supervisor(redis: Redis, cfg: FleetConfig, backend: LocalBackend, grace: float = 300.0) -> Supervisor:
    return Supervisor(cfg, redis, backend, Placement(discover(cfg.gpus)[0]), drain_grace_s=grace)


def _ignores_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(next(ln for ln in status.splitlines() if ln.startswith("SigIgn:")).split()[1], 16)
    return bool(ignored & (1 << (signal.SIGTERM - 1)))


async def until_ignores_sigterm(pid: int, limit_s: float = 10.0) -> None:
    """Until the process has set SIGTERM to ignored (the kernel says so in /proc/PID/status)."""
    for _ in range(int(limit_s / 0.02)):
        if _ignores_sigterm(pid):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"process {pid} did not ignore SIGTERM within {limit_s} s")


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
    assert rec is not None and rec.pid is not None
    await until_ignores_sigterm(rec.pid)  # its trap is in place
    assert await sup.drain(rec.id) and not await sup.drain(rec.id)  # once
    # Within the grace: the SIGTERM was ignored (the process lives on) and nothing was killed.
    assert await sup.poll(set()) == [] and rec.state == "draining" and sup.backend.alive(rec)
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


async def test_a_start_timeout_doubles_the_next_limit_and_a_loading_replica_is_not_killed(redis: Redis) -> None:
    """The sim profile said 2 s (limit 14 s) but the engine takes a minute: every start
    was killed at 14 s for ever. Now each timeout doubles the tier's limit, the timed-out
    start is a lower bound on the start-up, and a replica still beating `starting` is left
    to load."""
    cfg = config(f"t{uuid.uuid4().hex[:8]}")
    sup = supervisor(redis, cfg, StandIn())
    a = await sup.start("planner")
    assert a is not None
    a.launched -= 15
    (ev,) = await sup.poll(set(), startup_s=2.0, tier="planner", beating_ids=set())
    assert ev.event == "start_timeout" and "after 14 s" in ev.detail
    assert ev.at_least_s is not None and ev.at_least_s >= 15
    b = await sup.start("planner")
    assert b is not None
    b.launched -= 15  # past the first limit, within the doubled one (28 s)
    assert await sup.poll(set(), startup_s=2.0, tier="planner", beating_ids=set()) == []
    b.launched -= 60  # 75 s: past 28 s, but its heartbeat says starting: it is loading
    assert await sup.poll(set(), startup_s=2.0, tier="planner", beating_ids={b.id}) == []
    (ev,) = await sup.poll(set(), startup_s=2.0, tier="planner", beating_ids=set())  # silent: stopped
    assert ev.event == "start_timeout" and "after 28 s" in ev.detail
    # A start that reaches ready resets the doubling (once the first stopped one has left its GPUs).
    await until_gone(sup, a.id)
    c = await sup.start("planner")
    assert c is not None
    assert [e.event for e in await sup.poll({c.id}, startup_s=2.0, tier="planner", beating_ids={c.id})] == ["ready"]
    assert sup.start_timeouts["planner"] == 0
    await sup.stop_all(5)


async def test_a_ready_replica_whose_heartbeat_stops_is_killed_and_reported_died(redis: Redis) -> None:
    """Wedged: the process lives but beats no more. It used to count as ready for ever."""
    cfg = config(f"t{uuid.uuid4().hex[:8]}")  # heartbeat 0.25 s: wedged after 2 * (0.75 + 1) = 3.5 s silent
    sup = supervisor(redis, cfg, StandIn())
    rec = await sup.start("planner")
    assert rec is not None
    assert [e.event for e in await sup.poll({rec.id}, tier="planner", beating_ids={rec.id})] == ["ready"]
    assert await sup.poll(set(), tier="planner", beating_ids=set()) == []  # a missed beat is not yet wedged
    assert await sup.poll(set(), tier="planner") == []  # unobserved heartbeats judge nothing
    sup.last_beat[rec.id] -= 10
    (ev,) = await sup.poll(set(), tier="planner", beating_ids=set())
    assert (ev.replica, ev.event) == (rec.id, "died") and "no heartbeat" in ev.detail
    assert rec.state == "stopping"
    assert await until_gone(sup, rec.id) == []  # killed: it leaves without a second report
    assert sup.placement.room(2, 70) == 2


async def test_one_tiers_launch_failure_does_not_stop_the_others(redis: Redis) -> None:
    """A tier whose launches raise used to end the tick before the tiers after it."""
    from scaler.loop import Scaler

    class Broken(StandIn):
        def launch(self, rec: Supervised) -> None:
            if rec.tier == "alpha":
                raise RuntimeError("no such image")
            super().launch(rec)

    ns = f"t{uuid.uuid4().hex[:8]}"
    cfg = FleetConfig.model_construct(namespace=ns, tiers={"alpha": TierConfig(warm_floor=1),
                                                           "beta": TierConfig(warm_floor=1)},
                                      gpus=[], heartbeat_s=0.25)
    sup = supervisor(redis, cfg, Broken())
    scaler = Scaler(cfg, redis, sup, tick_s=0.1, lease_s=5.0)
    try:
        await scaler.step()
        assert [r.tier for r in sup.records.values()] == ["beta"]
        events = [{k.decode(): v.decode() for k, v in f.items()}
                  for _, f in await redis.xrange(TierKeys(ns, "alpha").decisions)]
        failed = [e for e in events if e.get("event") == "launch_failed"]
        assert failed and "no such image" in failed[0]["reason"]
        assert await redis.hget(TierKeys(ns, "alpha").scaler, "launch_failures") == b"1"
        # Lost the lease to another scaler: it stops acting before the next start.
        await redis.set(scaler.lease.key, "someone-else")
        await sup.stop_all(5)
        assert await scaler._execute("beta", _order_one(), []) == " (started 0; lease lost)"
        assert not scaler.leader and not sup.records
    finally:
        await sup.stop_all(5)
        await redis.delete(scaler.lease.key)


def _order_one() -> ScaleDecision:

    return ScaleDecision(action="scale_out", delta=1, reason="scale_out: test", code="floor", floor=1, ceiling=4,
                         ceiling_by="max_replicas", desired=1, drain_s=0.0, calm_since=None)


async def test_a_redis_outage_does_not_make_every_replica_wedged(redis: Redis) -> None:
    """The scaler's ticks fail while Redis is away (nothing polls), and after it the heartbeats are
    stale for a beat or two: that silence is the store's, not the replicas'. Before issue 12 the
    first tick after an outage longer than the wedged limit killed every ready replica."""
    # A short beat, so that the windows (and the test) are short: the wedged limit keeps its
    # fixed second, 2 * (3 * 0.05 + 1) = 2.3 s silent; unpolled for 3 * 0.05 + 1 = 1.15 s is blind.
    hb = 0.05
    limit = 2 * (3 * hb + 1)
    assert wedged(0.0, limit + 0.01, hb) and not wedged(0.0, limit - 0.01, hb)  # the policy's own window
    cfg = config(f"t{uuid.uuid4().hex[:8]}", heartbeat_s=hb)
    sup = supervisor(redis, cfg, StandIn())
    rec = await sup.start("planner")
    assert rec is not None
    assert [e.event for e in await sup.poll({rec.id}, tier="planner", beating_ids={rec.id})] == ["ready"]
    outage_s = limit + 0.5  # longer than the wedged limit: the first tick after it must not kill
    # The outage itself: the scaler's ticks fail, nothing is polled, and all the supervisor holds of
    # that time is when it last polled the tier and last saw the replica beat. Both set back by
    # the outage, as sitting it out would leave them (the test then need not sit it out).
    sup.watched["planner"] -= outage_s
    sup.last_beat[rec.id] -= outage_s
    assert await sup.poll(set(), tier="planner", beating_ids=set()) == []  # stale beats right after it
    assert rec.state == "ready"
    # A replica that stays silent once the scaler sees again is still found wedged, a full window later.
    back = time.monotonic()
    while not (events := await sup.poll(set(), tier="planner", beating_ids=set())):
        assert time.monotonic() - back < 10, "a silent replica was never found wedged"
        await asyncio.sleep(0.05)
    assert [e.event for e in events] == ["died"] and time.monotonic() - back > limit - 0.5
    await until_gone(sup, rec.id)
