"""The scaler live, on real Redis, with sim workers it starts itself (cold start ~1.5 s
plus the process start): bursts, drains, staged scale-in, pre-warm ahead of a window,
dead replicas replaced, a standby taking over, and the operator's pre-warm."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from fastapi.testclient import TestClient

from fleet.config import FleetConfig, load_config
from fleet.redis_server import free_port
from fleet.store.keys import TierKeys, scaler_leader_key
from tests.harness import ROOT, Fleet, config_variant, wait_until
from tests.scaler_harness import (
    ADMIN,
    HOLD_S,
    SCALER_CONFIG,
    TIER,
    burst,
    heartbeats,
    published,
    ready,
    start_scaler,
    stream,
)


def test_burst_scales_out_counting_starting_drains_and_steps_down_when_idle(sfleet: Fleet) -> None:
    f = sfleet
    start_scaler(f)
    wait_until(lambda: len(ready(f)) == 1, 45, what="the warm floor (1 replica) ready")
    first = set(ready(f))
    # The scaler's own view too: its `ready` event for the floor replica is stamped at its next tick
    # after the beat said ready (up to a tick later), and before it the floor counts as starting.
    wait_until(lambda: published(f).get("ready") == "1", 10, interval=0.05, what="the scaler counting the floor ready")

    t_burst = time.time()
    burst(f, 24)  # ~6 s of work for one replica at ~4 requests/s: drain far over 2 s
    t_empty = None
    peak = 0
    while (done := f.counters(TIER).get("completed", 0)) < 24:
        assert time.time() - t_burst < 60, f"burst not served: {done}/24 completed"
        if t_empty is None and f.r.zcard(f.keys(TIER).line) == 0:
            t_empty = time.time()
        p = published(f)
        peak = max(peak, int(p.get("ready", 0)) + int(p.get("starting", 0)))
        time.sleep(0.05)
    assert t_empty is not None
    c = f.counters(TIER)
    assert c.get("failed", 0) == 0 and c.get("expired", 0) == 0  # nothing dropped

    # Back to the floor, a hold period after the line emptied.
    # Nothing starting either: on a loaded machine the one ready replica can serve the burst
    # before the ordered ones come up, and those have no heartbeat yet.
    wait_until(lambda: published(f).get("ready") == "1" and published(f).get("draining") == "0"
               and published(f).get("starting") == "0" and len(heartbeats(f)) == 1, 60, interval=0.2,
               what="the tier back at its floor")
    entries = stream(f, t_burst)
    outs = [e for e in entries if e.get("action") == "scale_out"]
    ins = [e for e in entries if e.get("action") == "scale_in"]
    # The ready events of the replicas the burst ordered. Not the floor replica's: the test saw its
    # heartbeat say ready, but the scaler stamps its `ready` event at the tick it reads that beat,
    # which can come after t_burst; counted here, it made every later order look one short
    # (`counted == ordered - came_up` failed by one: the race "between a decision record and a
    # ready beat").
    readies = [e for e in entries if e.get("event") == "ready" and e.get("replica") not in first]
    assert outs, entries
    # Ordered on the line within a tick or so of the burst (a loaded machine gets slack).
    assert float(outs[0]["at"]) - t_burst < 2.0
    assert outs[0]["reason"].startswith("scale_out: drain")
    started = sum(int(e["delta"]) for e in outs)
    assert 2 <= started <= 6, outs  # enough for 24 + what arrives during start-up; well below the ceiling of 10
    assert peak <= 1 + started
    # While they started, the scaler counted them instead of ordering again: every later order
    # counted exactly the replicas ordered before it and not ready yet.
    assert any(e["reason"].startswith("hold: ") and "starting" in e["reason"] for e in entries)
    # A replica stops counting as starting at its first `ready`, or at a `start_timeout` / `died`
    # (the scaler stopped it or it died while starting): each stamped before the decision that
    # no longer counts it, in the same tick at the latest.
    left_starting: dict[str, float] = {}
    for ev in entries:
        if ev.get("event") in ("ready", "start_timeout", "died") and ev.get("replica") not in first:
            left_starting.setdefault(ev["replica"], float(ev["at"]))
    for i, e in enumerate(outs[1:], 1):
        ordered = sum(int(o["delta"]) for o in outs[:i])
        came_up = sum(1 for at in left_starting.values() if at <= float(e["at"]))
        counted = int(re.search(r"counting (\d+) starting", e["reason"]).group(1))  # type: ignore[union-attr]
        assert counted == ordered - came_up, (e, outs, readies)
    # Scale-in: exactly what was added, each step a hold period after the last (down to the need
    # the hold saw), only after the line emptied and every new replica was ready (never while one
    # starts).
    assert -sum(int(e["delta"]) for e in ins) == started and all(int(e["delta"]) <= -1 for e in ins), ins
    t_in = [float(e["at"]) for e in ins]
    assert t_in[0] >= t_empty - 0.5
    assert t_in[0] >= max(float(e["at"]) for e in readies)
    assert all(b - a >= HOLD_S - 0.3 for a, b in itertools.pairwise(t_in)), t_in
    assert set(heartbeats(f)) == first  # the youngest left first; the original replica stayed warm


def test_scheduled_prewarm_raises_the_floor_ahead_of_the_window_and_steps_down_after(sfleet: Fleet,
                                                                                    tmp_path: Path) -> None:
    f = sfleet
    start = int(time.time()) + 16  # the window opens in 16 s, for 4 s; once (a daily cron)
    s = datetime.fromtimestamp(start, UTC)
    f.config_path = config_variant(SCALER_CONFIG, tmp_path, TIER,
                                   prewarm=[{"cron": f"{s.minute} {s.hour} * * * {s.second}", "floor": 3,
                                             "duration_s": 4}])
    start_scaler(f)
    wait_until(lambda: len(ready(f)) == 1, 45, what="the warm floor ready")
    wait_until(lambda: published(f).get("prewarm_floor") == "3", start + 2 - time.time(), interval=0.05,
               what="the pre-warm floor")
    raised = time.time()
    p = published(f)
    lead = float(p["startup_s"])
    # Raised ahead of the window, by about the measured start-up: the cold-start tax is paid before the load.
    assert raised < start - 0.5 * lead, (raised - start, lead)
    out = next(e for e in stream(f) if e.get("action") == "scale_out" and "pre-warm" in e["reason"])
    assert out["reason"] == "scale_out: floor 3 (pre-warm), +2 counting 0 starting"
    assert float(out["at"]) < start
    assert p["prewarm_source"].startswith("schedule")
    wait_until(lambda: len(ready(f)) >= 3, start + 20 - time.time(), what="3 replicas resident")
    # After the window: down to the warm floor once a hold has passed with no need for them.
    wait_until(lambda: published(f).get("ready") == "1" and len(heartbeats(f)) == 1, 40, interval=0.2,
               what="back at the warm floor")
    ins = [float(e["at"]) for e in stream(f) if e.get("action") == "scale_in"]
    steps = [(float(e["at"]), int(e["delta"])) for e in stream(f) if e.get("action") == "scale_in"]
    assert -sum(d for _, d in steps) == 2 and ins[0] >= start + 4, steps
    assert all(b - a >= HOLD_S - 0.3 for a, b in itertools.pairwise(ins)), ins


@pytest.mark.parametrize("store_url", ["redis", "cluster"], indirect=True)  # the leader lease on a cluster too
def test_dead_replica_is_replaced_and_a_standby_takes_over(sfleet: Fleet) -> None:
    f = sfleet
    a = start_scaler(f)
    wait_until(lambda: len(ready(f)) == 1, 45, what="the warm floor ready")
    leader_a = f.r.get(scaler_leader_key(f.namespace)).decode()
    b = start_scaler(f)
    victim = next(iter(ready(f)))

    # A replica that dies is replaced, and counted.
    os.kill(heartbeats(f)[victim]["pid"], signal.SIGKILL)
    # One read of the beats per check: read twice, the first could still hold the victim's beat
    # and the second none (the scaler removes a dead replica's), which passed with no
    # replacement ready, before the scale-out that replaces it was even decided.
    wait_until(lambda: bool(r := ready(f)) and victim not in r, 45, what="a replacement replica ready")
    # The death is recorded by the scaler that saw it, which may be a moment after the beats moved.
    died = wait_until(lambda: [e for e in stream(f) if e.get("event") == "died"], 15, what="the death recorded")
    assert [e["replica"] for e in died] == [victim]
    assert published(f)["deaths"] == "1"
    assert any("replaces " + victim in e["reason"] for e in stream(f) if e.get("action") == "scale_out")
    (replacement,) = ready(f)

    # The standby has stood by: it decided nothing.
    assert {e["scaler"] for e in stream(f)} == {leader_a}
    a.send_signal(signal.SIGKILL)
    killed = time.time()
    a.wait(10)
    wait_until(lambda: f.r.get(scaler_leader_key(f.namespace)) not in (None, leader_a.encode()), 15,
               interval=0.05, what="the standby holding the lease")
    took = time.time() - killed
    assert took < 6, f"takeover took {took:.1f} s"
    leader_b = f.r.get(scaler_leader_key(f.namespace)).decode()
    wait_until(lambda: published(f).get("scaler") == leader_b, 10, what="the standby deciding")
    # It adopted the running replica instead of starting another: after four of its ticks
    # (0.25 s each), it has ordered nothing, and nothing is starting.
    first_tick = float(published(f)["ts"])
    wait_until(lambda: float(published(f)["ts"]) >= first_tick + 1.0, 10, what="four ticks of the new leader")
    assert not [e for e in stream(f) if e.get("scaler") == leader_b and e.get("action") == "scale_out"]
    assert ready(f) == {replacement} and published(f)["starting"] == "0"

    # An operator pre-warm, through the CLI and the gateway, is applied by the new leader.
    port = free_port()
    f.port = port
    f.spawn("gateway", "--port", str(port))
    wait_until(f._gateway_ready, 30, what="gateway ready")
    cli = subprocess.run([sys.executable, "-m", "fleetctl", "prewarm", TIER, "--floor", "2", "--for", "90s",
                          "--url", f.base_url, "--api-key", "sk-admin"], env=f.env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(f"{TIER}: floor 2 until ")
    wait_until(lambda: len(ready(f)) == 2, 45, what="the operator's floor of 2")
    p = published(f)
    assert (p["prewarm_floor"], p["prewarm_source"], p["floor"]) == ("2", "operator", "2")
    # The status page shows the same.
    doc = httpx.get(f"{f.base_url}/v1/fleet/status", headers=ADMIN, timeout=10).json()["tiers"][TIER]
    assert doc["floor"] == 2 and doc["prewarm"]["source"] == "operator"
    assert doc["last_decision"]["action"] in ("hold", "scale_out") and doc["last_decision"]["reason"]

    # Stopping the leader drains what it adopted and what it started.
    b.send_signal(signal.SIGTERM)
    b.wait(60)
    wait_until(lambda: not heartbeats(f), 20, what="every replica drained")


# --- POST /v1/fleet/prewarm ----------------------------------------------------------------


@pytest.fixture
def api(redis_url: str) -> Iterator[tuple[TestClient, FleetConfig, str]]:
    from gateway.app import create_app

    cfg = load_config(SCALER_CONFIG, namespace=f"t{uuid.uuid4().hex[:10]}")
    with TestClient(create_app(cfg, redis_url)) as client:
        yield client, cfg, redis_url




def test_prewarm_api_is_for_admins_and_checks_its_input(api: tuple[TestClient, FleetConfig, str]) -> None:
    client, cfg, redis_url = api
    body = {"tier": TIER, "floor": 3, "duration_s": 600}
    r = client.post("/v1/fleet/prewarm", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = client.post("/v1/fleet/prewarm", json=body, headers={"authorization": "Bearer sk-agent"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"

    t0 = time.time()
    r = client.post("/v1/fleet/prewarm", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tier"] == TIER and got["floor"] == 3 and t0 + 599 < got["until"] < time.time() + 601
    until = datetime.fromtimestamp(time.time() + 120, UTC).isoformat()
    r = client.post("/v1/fleet/prewarm", json={"tier": TIER, "floor": 2, "until": until}, headers=ADMIN)
    assert r.status_code == 200 and abs(r.json()["until"] - datetime.fromisoformat(until).timestamp()) < 1e-3

    stored = redis.Redis.from_url(redis_url).hgetall(TierKeys(cfg.namespace, TIER).prewarm)
    assert sorted(orjson.loads(v)["floor"] for v in stored.values()) == [2, 3]

    bad = [
        ({"tier": "nope", "floor": 1, "duration_s": 5}, 404, "tier"),
        ({"tier": TIER, "floor": 99, "duration_s": 5}, 422, "floor"),
        ({"tier": TIER, "floor": -1, "duration_s": 5}, 422, "floor"),
        ({"tier": TIER, "floor": 1}, 422, "duration_s"),
        ({"tier": TIER, "floor": 1, "duration_s": 5, "until": time.time() + 9}, 422, "duration_s"),
        ({"tier": TIER, "floor": 1, "until": time.time() - 5}, 422, "until"),
        ({"tier": TIER, "floor": 1, "until": "tomorrow"}, 422, "until"),
        ({"tier": TIER, "floor": 1, "until": "2030-01-01T08:25:00"}, 422, "until"),
        ({"tier": TIER, "floor": 1, "duration_s": 30 * 86400}, 422, "duration_s"),
        ({"tier": TIER, "floor": 1, "duration_s": 5, "extra": 1}, 422, "extra"),
    ]
    for payload, status, param in bad:
        r = client.post("/v1/fleet/prewarm", json=payload, headers=ADMIN)
        assert r.status_code == status, (payload, r.text)
        assert r.json()["error"]["param"] == param, (payload, r.text)
    r = client.post("/v1/fleet/prewarm", content=b"{not json", headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

