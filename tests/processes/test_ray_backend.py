"""`fleet scaler --backend ray` against a real Ray cluster on this machine: a head with
no GPUs and two worker nodes declaring one GPU each (Ray's own multi-node test
cluster, bound to 127.0.0.1). Replicas are placed by Ray with CUDA_VISIBLE_DEVICES
set, drained on scale-in, adopted by a restarted scaler, and replaced on the other
node when theirs dies, with what they held requeued by its leases."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.harness import Fleet, wait_until
from tests.scaler_harness import SCALER_CONFIG, TIER, burst, published, ready, start_scaler, stream

ray_cluster_utils = pytest.importorskip("ray.cluster_utils", reason="the ray extra: pip install '.[ray]'")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[Any, list[Any]]]:
    c = ray_cluster_utils.Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 2, "num_gpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    try:
        nodes = [c.add_node(num_cpus=2, num_gpus=1, node_ip_address="127.0.0.1") for _ in range(2)]
        c.wait_for_nodes()
        yield c, nodes
    finally:
        c.shutdown()


def supervised(f: Fleet) -> dict[str, dict[str, Any]]:
    return {k.decode(): orjson.loads(v) for k, v in f.r.hgetall(f.keys(TIER).supervised).items()}


def cuda_of(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")), None)


@pytest.mark.timeout(180)  # the whole story, cluster start-up included, in under 3 minutes
def test_replicas_on_ray_place_drain_adopt_and_move_off_a_dead_node(ray_cluster: tuple[Any, list[Any]],
                                                                    redis_url: str, tmp_path: Path) -> None:
    import yaml

    cluster, nodes = ray_cluster
    cfg = yaml.safe_load(SCALER_CONFIG.read_text())
    cfg["tiers"][TIER].update(gpus_per_replica=1, max_replicas=2)  # two GPU nodes of one GPU each
    path = tmp_path / "fleet-ray.yaml"
    path.write_text(yaml.safe_dump(cfg))
    f = Fleet(redis_url, config_path=path)
    ray_args = ("--backend", "ray", "--ray-address", cluster.address)
    try:
        scaler = start_scaler(f, *ray_args)
        wait_until(lambda: len(ready(f)) == 1, 90, what="the warm floor on a Ray GPU node")

        # A burst: a second replica, which Ray can only put on the other GPU node.
        t_burst = time.time()
        burst(f, 24)
        wait_until(lambda: len(ready(f)) == 2, 90, what="a second replica")
        recs = supervised(f)
        assert {r["backend"] for r in recs.values()} == {"ray"}
        assert len({r["host"] for r in recs.values()}) == 2, recs  # one per node
        assert {r["host"] for r in recs.values()} <= {n.node_id for n in nodes[:2]}
        assert all(cuda_of(r["pid"]) == "0" for r in recs.values()), recs  # Ray's GPU, inherited by the worker
        wait_until(lambda: f.counters(TIER).get("completed", 0) >= 24, 90, what="the burst served")
        # Idle again: scale-in drains one (it exits on its own, code 0), back to the floor.
        wait_until(lambda: any(e.get("event") == "drained" for e in stream(f, t_burst)), 60,
                   what="a replica drained on scale-in")
        drained = next(e for e in stream(f, t_burst) if e.get("event") == "drained")
        assert "exit 0" in drained["reason"], drained
        wait_until(lambda: len(supervised(f)) == 1 and len(ready(f)) == 1, 30, what="back at the floor")
        (survivor,) = supervised(f)

        # The scaler dies; a new one adopts the running actor instead of starting another.
        scaler.send_signal(signal.SIGKILL)
        scaler.wait(10)
        t_restart = time.time()
        start_scaler(f, *ray_args)
        wait_until(lambda: float(published(f).get("at", 0)) > t_restart + 2, 60,
                   what="the new scaler deciding for a few ticks")
        assert set(supervised(f)) == {survivor} and ready(f) == {survivor}
        assert not [e for e in stream(f, t_restart) if e.get("action") == "scale_out"]

        # Its node dies with work in flight: a replacement on the other node, nothing lost.
        before = f.counters(TIER)
        burst(f, 6, max_tokens=60)  # ~3 s each at 50 ms a token: some are held when the node dies
        wait_until(lambda: f.r.zcard(f.keys(TIER).inflight) > 0, 30, what="requests in flight")
        host = supervised(f)[survivor]["host"]
        cluster.remove_node(next(n for n in nodes if n.node_id == host))
        wait_until(lambda: any(rid != survivor for rid in ready(f)), 120, what="a replacement ready")
        (moved,) = [r for rid, r in supervised(f).items() if rid != survivor]
        assert moved["host"] != host
        wait_until(lambda: f.counters(TIER).get("completed", 0) >= before.get("completed", 0) + 6, 90,
                   what="the node's requests completed elsewhere")
        after = f.counters(TIER)
        assert after.get("requeued", 0) > before.get("requeued", 0)  # by their leases
        assert after.get("failed", 0) == before.get("failed", 0)
        assert any(e.get("event") == "died" and e.get("replica") == survivor for e in stream(f, t_restart))
    finally:
        f.stop()
