"""What is judged once and read by the rest, on a real Redis: the budget governor runs under the
scaler's lease (the gateway ticks it only while no scaler holds it), and the scaler's calibrated
capacity reaches the gateways' admission."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import orjson
import pytest
import redis
from fastapi.testclient import TestClient
from redis.asyncio import Redis

from fleet.config import Budget, FleetConfig, Priority, load_config
from fleet.policy import Calibration, PlanState, tier_capacity
from fleet.store.capacity import publish_calibration, read_calibration
from fleet.store.keys import TierKeys, scaler_leader_key
from fleet.store.line import Line
from scaler.loop import Scaler
from scaler.placement import Placement
from scaler.supervisor import Supervisor
from tests.backends import NoLaunch
from tests.paths import TESTS

SCALER_CONFIG = TESTS / "fleet-scaler.yaml"
TIER = "routing"


def _config(**tier: object) -> FleetConfig:
    cfg = load_config(SCALER_CONFIG, namespace=f"t{uuid.uuid4().hex[:10]}")
    for k, v in tier.items():
        setattr(cfg.tiers[TIER], k, v)
    return cfg


@pytest.fixture
def gateway(redis_url: str) -> Iterator[tuple[TestClient, FleetConfig, redis.Redis]]:
    from gateway.app import create_app

    cfg = _config(hourly_usd=3600.0, budget=Budget(daily_usd=100.0))
    r = redis.Redis.from_url(redis_url)
    r.set(scaler_leader_key(cfg.namespace), "a-scaler", px=120_000)  # a scaler acts: the gateway must not judge
    try:
        with TestClient(create_app(cfg, redis_url)) as client:
            yield client, cfg, r
    finally:
        r.delete(scaler_leader_key(cfg.namespace))
        r.close()


def test_the_gateway_judges_the_budget_only_while_no_scaler_holds_the_lease(
        gateway: tuple[TestClient, FleetConfig, redis.Redis]) -> None:
    client, cfg, r = gateway
    gw = client.app.state.gw  # type: ignore[attr-defined]
    budget = TierKeys(cfg.namespace, TIER).budget
    tick = client.portal.call  # type: ignore[union-attr]  # on the app's own event loop
    tick(gw.govern_unless_a_scaler_does)  # what its loop runs each heartbeat
    assert not r.exists(budget)  # the scaler's judgement is the one that counts
    status = {"authorization": "Bearer sk-admin"}  # fleet state is for keys that may read it
    assert client.get("/v1/fleet/status", headers=status).json()["tiers"][TIER]["budget"] is None  # none published
    r.delete(scaler_leader_key(cfg.namespace))  # no scaler any more: budgets must still hold
    tick(gw.govern_unless_a_scaler_does)
    assert r.hget(budget, "window") == b"daily" and float(r.hget(budget, "budget")) == 100.0
    doc = client.get("/v1/fleet/status", headers=status).json()["tiers"][TIER]
    assert doc["budget_usd"] == 100.0 and doc["budget"]["window"] == "daily"


async def test_the_scaler_publishes_its_calibration_and_admission_plans_with_it(redis_url: str) -> None:
    cfg = _config()
    r = Redis.from_url(redis_url)
    k = TierKeys(cfg.namespace, TIER)
    try:
        # A saturated, steady line: one replica, 40 waiting for over a window, served at a quarter
        # of what the profile expects.
        line = Line(r, cfg.namespace, TIER, rate_window_s=cfg.rate_window_s)
        for _ in range(40):
            await line.enqueue(uuid.uuid4().hex, Priority.interactive, b"{}", 60_000)
        model = tier_capacity(cfg.tiers[TIER]).per_replica_rate
        now_ms = int(time.time() * 1000)
        served = round(model * cfg.rate_window_s / 4)
        await r.zadd(k.completions, {f"c{i}": now_ms - 10 * i for i in range(served)})
        await r.hset(k.request((await r.zrange(k.line, 0, 0))[0].decode()), "enq", now_ms - 60_000)
        beat = {"state": "ready", "slots": 2, "in_use": 2, "completed": 0, "cold_start_s": 7.0,
                "ts": time.time(), "started": time.time() - 120}
        await r.hset(k.replicas, f"{TIER}-a", orjson.dumps(beat))
        scaler = Scaler(cfg, r, Supervisor(cfg, r, NoLaunch(), Placement([])))  # type: ignore[arg-type]
        scaler.plans[TIER] = PlanState(Calibration(startup_s=7.0, ready=1, ready_since=time.time() - 60))
        await scaler.tick_tier(TIER)
        cal = await read_calibration(r, k)
        assert cal is not None and cal.startup_s == 7.0  # the engine's own cold start, measured
        assert cal.rate_factor == pytest.approx(0.25, rel=0.1)  # slower than the profile: corrected down
        # The gateways' admission plans with what the scaler published.
        from gateway.admission import Admission

        adm = Admission(cfg, r, {TIER: line})
        await adm.refresh()
        cap = adm.views[TIER].capacity
        assert cap.startup_s == 7.0 and cap.per_replica_rate == pytest.approx(model * cal.rate_factor)
        # No scaler publishing (its calibration went stale): the gateway falls back on the heartbeats.
        await publish_calibration(r, k, Calibration(startup_s=99.0), time.time() - 3600)
        await adm.refresh()
        assert adm.views[TIER].capacity.startup_s == 7.0 and adm.views[TIER].capacity.rate_factor == 1.0
    finally:
        await r.aclose()
