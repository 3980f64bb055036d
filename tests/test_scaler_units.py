"""The scaler's parts on their own: GPU placement, the Docker container spec, the
leader lease and the pre-warm store on real Redis, durations for `fleet prewarm`."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis

from fleet.config import GpuInventory
from fleet.keys import TierKeys
from fleet.prewarm import add_order, parse_duration, read_orders
from scaler.backends import LocalBackend, Supervised, container_spec
from scaler.lease import Lease
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

