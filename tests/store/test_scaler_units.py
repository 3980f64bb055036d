"""The scaler's parts on their own: GPU placement, the Docker container spec, the
leader lease and the pre-warm store on real Redis, durations for `fleet prewarm`."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis

from fleet.config import Budget, BudgetWindow, GpuInventory, TierConfig
from fleet.durations import parse_duration
from fleet.policy import budget_ceiling_for, gpu_ceiling, tier_has_budget
from fleet.store.keys import TierKeys
from fleet.store.leader import Lease
from fleet.store.prewarm_orders import add_order, read_orders
from scaler.backends import DockerBackend, LocalBackend, Supervised, container_spec
from scaler.placement import Placement, discover

# --- CUDA-aware placement -----------------------------------------------------------------


def test_places_on_gpus_with_room_best_fit_first() -> None:
    p = Placement([*discover([GpuInventory(index=0, memory_gb=80), GpuInventory(index=1, memory_gb=80)])[0]])
    assert p.room(1, 12) == 12  # 6 per 80 GB GPU
    assert p.place("r1", 1, 40) == (0,)
    # Best fit: the next 40 GB replica goes where 40 GB is left, keeping GPU 1 whole for a planner.
    assert p.place("r2", 1, 40) == (0,)
    assert p.place("planner-1", 2, 70) is None  # needs two GPUs with 70 GB free; only GPU 1 has it
    assert p.room(2, 70) == 0
    p.release("r2")
    assert p.room(1, 40) == 3
    assert p.place("r3", 1, 50) == (1,)
    assert p.free_gb() == {0: 40.0, 1: 30.0}


def test_two_gpu_replicas_get_two_distinct_gpus() -> None:
    p = Placement(discover([GpuInventory(index=i, memory_gb=80) for i in range(4)])[0])
    assert p.room(2, 70) == 2
    a, b = p.place("a", 2, 70), p.place("b", 2, 70)
    assert a is not None and b is not None and len(set(a)) == 2 and not set(a) & set(b)
    assert p.place("c", 2, 70) is None


def test_no_inventory_or_no_gpu_need_means_no_gpu_limit() -> None:
    gpus, source = discover([])
    assert (gpus, source) == ([], "none")  # no NVML on this machine, no `gpus:` in the config
    p = Placement(gpus)
    assert p.room(1, 12) is None and p.place("x", 1, 12) == ()
    p = Placement(discover([GpuInventory(index=0, memory_gb=24)])[0])
    assert p.room(0, 0) is None and p.place("cpu-only", 0, 0) == ()


def test_local_backend_puts_the_replica_on_its_gpus() -> None:
    be = LocalBackend({"PATH": "/usr/bin"})
    rec = Supervised(id="routing-1", tier="routing", backend="local", launched=0.0, gpus=(2, 3))
    assert be.command(rec)[-4:] == ["--tier", "routing", "--replica-id", "routing-1"]
    assert Supervised.loads(rec.dumps()) == rec


def test_docker_spec_requests_the_gpus_and_labels_the_container() -> None:
    rec = Supervised(id="planner-ab", tier="planner", backend="docker", launched=0.0, gpus=(0, 1), gpu_gb=70)
    spec = container_spec("fleet", "fleet-gateway:latest", rec, {"REDIS_URL": "redis://redis:6379/0"},
                          network="fleet", engine="vllm", volumes=["/srv/models:/models:ro"])
    assert spec["volumes"] == ["/srv/models:/models:ro"]
    assert spec["command"] == ["fleet", "worker", "--tier", "planner", "--replica-id", "planner-ab", "--engine", "vllm"]
    (req,) = spec["device_requests"]
    assert req["DeviceIDs"] == ["0", "1"] and req["Capabilities"] == [["gpu"]]
    assert spec["labels"]["fleet.replica.namespace"] == "fleet"
    assert spec["labels"]["fleet.replica.gpus"] == "0,1" and spec["labels"]["fleet.replica.id"] == "planner-ab"
    assert spec["network"] == "fleet" and spec["stop_signal"] == "SIGTERM" and spec["detach"]
    cpu = container_spec("fleet", "img", Supervised(id="r", tier="routing", backend="docker", launched=0), {})
    assert "device_requests" not in cpu


# --- Durations ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "secs"), [("45m", 2700), ("90s", 90), ("1h30m", 5400), ("2h", 7200),
                                            ("120", 120), ("1.5h", 5400), ("1d", 86400)])
def test_durations(text: str, secs: float) -> None:
    assert parse_duration(text) == secs


@pytest.mark.parametrize("text", ["", "soon", "45x", "-5", "0", "5m soon", "m"])
def test_bad_durations_say_so(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


# --- On Redis ----------------------------------------------------------------------------


async def test_only_one_scaler_holds_the_lease(redis_url: str) -> None:
    r = Redis.from_url(redis_url)
    key = f"t{uuid.uuid4().hex[:8]}:scaler:leader"
    a, b = Lease(r, key, "a", 0.4), Lease(r, key, "b", 0.4)
    try:
        assert await a.hold() and not await b.hold()
        assert await a.hold() and await a.holder() == "a"  # renews
        await b.release()  # not b's to release
        assert await a.holder() == "a"
        await asyncio.sleep(0.6)  # a stopped renewing
        assert await b.hold() and not await a.hold()
        await b.release()
        assert await a.hold()
    finally:
        await r.delete(key)
        await r.aclose()


async def test_prewarm_orders_expire_and_are_pruned(redis_url: str) -> None:
    r = Redis.from_url(redis_url)
    keys = TierKeys(f"t{uuid.uuid4().hex[:8]}", "routing")
    now = time.time()
    try:
        live = await add_order(r, keys, 5, now + 60, now)
        await add_order(r, keys, 9, now - 1, now - 61)
        await r.hset(keys.prewarm, "junk", b"{not json")
        got = await read_orders(r, keys, now, prune=True)
        assert [(o.floor, o.until, o.id) for o in got] == [(5, live.until, live.id)]
        assert await r.hlen(keys.prewarm) == 1
    finally:
        await r.delete(keys.prewarm)
        await r.aclose()



# --- Ceilings the loop hands the policy -------------------------------------------------------


def test_gpu_ceiling_counts_draining_replicas_once() -> None:
    """Four 80 GB GPUs, one planner (2 GPUs) ready and one draining: no room left. The
    ceiling is 2 and `decide_tier` takes the draining one off it: 1 may run, which is
    what runs. The old `have + room` = 1 took the draining one off twice, leaving 0."""
    from fleet.policy import TierState, decide_tier

    placement = Placement(discover([GpuInventory(index=i, memory_gb=80) for i in range(4)])[0])
    placement.book("ready", (0, 1), 70)
    placement.book("draining", (2, 3), 70)
    room = placement.room(2, 70)
    assert room == 0 and gpu_ceiling(1, 1, room) == 2 and gpu_ceiling(1, 1, None) is None
    placement.release("draining")
    assert gpu_ceiling(1, 0, placement.room(2, 70)) == 2  # it left: room for one more
    # A busy tier with one ready and one draining holds (capped), it does not step down.
    s = TierState(waiting=50, oldest_wait_s=5, arrival_rate=20.0, service_rate=5.0, ready=1, starting=0,
                  per_replica_rate=5.0, startup_s=5.0, draining=1, gpu_ceiling=gpu_ceiling(1, 1, room),
                  calm_since=0.0)
    d = decide_tier(s, TierConfig(warm_floor=1, max_replicas=4, scale_in_hold_s=0), 1000.0)
    assert (d.action, d.ceiling) == ("capped", 2)


def test_budget_fails_closed_to_what_runs_when_the_governor_is_silent() -> None:
    budgeted = TierConfig(hourly_usd=9.8, budget=Budget(daily_usd=100))
    windowed = TierConfig(hourly_usd=9.8, budget=Budget(windows=[BudgetWindow(name="open", cron="* * * * *",
                                                                               duration_s=60, usd=1)]))
    free = TierConfig(hourly_usd=9.8)
    assert tier_has_budget(budgeted) and tier_has_budget(windowed) and not tier_has_budget(free)
    assert not tier_has_budget(TierConfig(hourly_usd=0.0, budget=Budget(daily_usd=100)))  # replicas cost nothing
    # Judged: the published ceiling (none published: unbounded).
    assert budget_ceiling_for(3, True, True, 5) == 3
    assert budget_ceiling_for(None, True, True, 5) is None
    # No fresh judgement: a budgeted tier keeps what it has but does not grow; others are unbounded.
    assert budget_ceiling_for(None, False, True, 5) == 5
    assert budget_ceiling_for(None, False, False, 5) is None


# --- Docker states ------------------------------------------------------------------------


class _Container:
    def __init__(self, status: str) -> None:
        self.status, self.id, self.attrs = status, "c1", {"State": {"ExitCode": 0}}
        self.calls: list[str] = []

    def kill(self, signal: str = "SIGKILL") -> None:
        self.calls.append(f"kill {signal}")
        self.status = "exited"

    def remove(self, force: bool = False) -> None:
        self.calls.append("remove")
        self.status = "removed"


class _Client:
    def __init__(self, c: _Container) -> None:
        self.c = c
        self.containers = self

    def get(self, _name: str) -> _Container:
        from docker.errors import NotFound

        if self.c.status == "removed":
            raise NotFound("gone")
        return self.c


@pytest.mark.parametrize("status", ["created", "restarting", "paused"])
def test_docker_kill_and_terminate_end_a_container_that_is_not_running(status: str) -> None:
    """A container stuck in `created` counted as alive and could never be killed."""
    rec = Supervised(id="planner-ab", tier="planner", backend="docker", launched=0.0, container="c1")
    for stop in ("kill", "terminate"):
        c = _Container(status)
        be = DockerBackend("fleet", "img", {}, client=_Client(c))
        assert be.alive(rec) == (status != "paused")
        getattr(be, stop)(rec)
        assert c.calls == ["remove"] and not be.alive(rec)
    running = _Container("running")
    be = DockerBackend("fleet", "img", {}, client=_Client(running))
    be.kill(rec)
    assert running.calls == ["kill SIGKILL"]


async def test_the_governor_prunes_marks_of_replicas_long_gone(redis_url: str) -> None:
    """`ledger:beats` kept one mark per replica id for ever; the governor now prunes it."""
    from fleet.config import FleetConfig
    from fleet.governor import govern

    r = Redis.from_url(redis_url)
    cfg = FleetConfig.model_construct(namespace=f"t{uuid.uuid4().hex[:8]}", tiers={"routing": TierConfig()},
                                      gpus=[], heartbeat_s=0.25)
    keys = TierKeys(cfg.namespace, "routing")
    now = time.time()
    try:
        await r.hset(keys.ledger_beats, mapping={"old": f"{int((now - 7200) * 1000)}|gone|1",
                                                 "live": f"{int((now - 5) * 1000)}|ready|2"})
        await govern(r, cfg, now)
        assert set(await r.hkeys(keys.ledger_beats)) == {b"live"}
    finally:
        await r.delete(keys.ledger_beats)
        await r.aclose()
