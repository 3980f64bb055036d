"""A replica whose engine dies stops claiming and exits non-zero (so its supervisor
replaces it); one whose engine cannot start says why, without a traceback."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from fleet.config import Priority, load_config
from fleet.store.line import Line
from tests.harness import ROOT, TEST_CONFIG, Fleet, call_payload
from workers.engines.base import Delta, Engine, EngineError, EngineRequest
from workers.worker import Worker


class DyingEngine(Engine):
    """An engine whose process died: every request fails with engine_dead."""

    cold_start_s = 0.01

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def start(self) -> None: ...

    async def generate(self, req: EngineRequest) -> AsyncGenerator[Delta, None]:
        self.seen.append(req.request_id)
        raise EngineError("engine core process died", "engine_error", code="engine_dead")
        yield  # pragma: no cover

    async def abort(self, request_id: str) -> None: ...

    async def stop(self) -> None: ...


async def test_dead_engine_drains_the_replica_and_fails_only_what_it_held(redis_url: str) -> None:
    cfg = load_config(TEST_CONFIG, namespace=f"t{uuid.uuid4().hex[:8]}")
    redis = Redis.from_url(redis_url)
    line = Line(redis, cfg.namespace, "routing")
    for _ in range(10):
        await line.enqueue(uuid.uuid4().hex, Priority.interactive, call_payload(max_tokens=2), 30_000)
    engine = DyingEngine()
    worker = Worker(cfg, "routing", engine, redis)
    await asyncio.wait_for(worker.run(), 30)
    assert worker.failed and "died" in worker.failed
    snap = await line.observe()
    # It claimed one batch (its slots), failed those, and left the rest in the line for a healthy replica.
    assert snap.counters["failed"] == len(engine.seen) <= cfg.tiers["routing"].slots
    assert snap.waiting == 10 - len(engine.seen) > 0
    assert await redis.hget(line.keys.replicas, worker.replica_id) is None
    await redis.aclose()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_engine_that_cannot_start_exits_1_with_a_reason(fleet: Fleet, tmp_path: Path) -> None:
    env = {**fleet.env, "FLEET_TIERS__ROUTING__VLLM__MODEL": str(tmp_path / "no-such-model"),
           "FLEET_TIERS__ROUTING__VLLM__KV_CACHE_MEMORY_BYTES": str(64 << 20)}
    r = subprocess.run([sys.executable, "-m", "fleetctl", "worker", "--tier", "routing", "--engine", "vllm"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "failed to start" in r.stderr
    assert "Traceback" not in r.stderr.split("failed to start")[-1]
