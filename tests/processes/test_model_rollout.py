"""Rollouts live: the scaler with sim workers it starts itself (local processes), two versions
with different sim profiles (tests/fleet-rollout.yaml), a steady load on the line throughout
(and, in the first test, callers streaming through the gateway).

A promotion replaces every replica one at a time with 0 failed calls and the ready never
below the floor; a rollback brings every replica back; a standby that takes the lease in
the middle of a rollout finishes it without acting on it twice; the registry survives a
restart of every part."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.redis_server import free_port
from fleet.store.keys import scaler_leader_key
from fleet.store.line import Line
from tests.harness import ROOT, Fleet, LineLoad, call_payload, config_variant, scaled_fleet, wait_until
from tests.paths import TESTS

CONFIG = TESTS / "fleet-rollout.yaml"
TIER = "routing"
FLOOR = 2


@pytest.fixture
def rfleet(redis_url: str) -> Iterator[Fleet]:
    with scaled_fleet(redis_url, CONFIG, TIER) as f:
        yield f


def start_scaler(f: Fleet, metrics_port: int = 0) -> subprocess.Popen[bytes]:
    return f.spawn("scaler", "--tick", "0.25", "--lease", "2", "--metrics-port", str(metrics_port),
                   "--stop-replicas-on-exit")


def beats(f: Fleet) -> dict[str, dict[str, Any]]:
    now = time.time()
    got = {k.decode(): orjson.loads(v) for k, v in f.r.hgetall(f.keys(TIER).replicas).items()}
    return {k: b for k, b in got.items() if now - b["ts"] < 5.0}


def versions(f: Fleet, state: str = "ready") -> list[str]:
    return sorted(b["version"] for b in beats(f).values() if b["state"] == state)


def events(f: Fleet) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in f.r.xrange(f.keys(TIER).decisions)]


def fleet_cmd(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "fleetctl", *args], env=f.env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def Load(f: Fleet, rate: float = 6.0) -> LineLoad:
    """A steady load on the tier's line, 6 a second by default."""
    return LineLoad(f.redis_url, f.namespace, TIER, rate, 60_000)


class Callers:
    """Callers through the gateway from a thread, one streamed chat call after another until
    stopped: what each got (the status, and whether the stream ended with [DONE])."""

    def __init__(self, f: Fleet) -> None:
        self.f, self.got = f, []  # type: ignore[var-annotated]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": TIER, "messages": [{"role": "user", "content": "route this"}], "max_tokens": 8,
                "stream": True}
        with httpx.Client(base_url=self.f.base_url, timeout=60,
                          headers={"authorization": "Bearer sk-agent"}) as c:
            while not self.stop.is_set():
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    text = r.read().decode()
                self.got.append((r.status_code, text.rstrip().endswith("data: [DONE]") and '"error"' not in text))

    def __enter__(self) -> Callers:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(70)


def rolled_to(f: Fleet, version: str) -> bool:
    """Every live replica runs `version` (the drained ones have left) and the floor is ready."""
    b = beats(f)
    return (len([x for x in b.values() if x["state"] == "ready"]) >= FLOOR
            and all(x["version"] == version for x in b.values()))


def watch_floor(f: Fleet, until: Any, timeout: float, what: str) -> int:
    """Wait for `until`, checking on every look that the ready replicas never fell below the floor;
    returns the fewest ready seen."""
    fewest = 99
    end = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < end, f"timed out after {timeout}s waiting for {what}: {beats(f)}"
        fewest = min(fewest, len(versions(f)))
        time.sleep(0.05)
    return fewest


def test_promote_under_load_replaces_every_replica_then_rollback_brings_them_back(rfleet: Fleet) -> None:
    f = rfleet
    f.start_gateway()
    start_scaler(f)
    wait_until(lambda: versions(f) == ["v1", "v1"], 60, what="the floor ready at v1", why=lambda: beats(f))
    with Load(f) as load, Callers(f) as callers:
        wait_until(lambda: f.counters(TIER).get("completed", 0) >= 10, 30, what="the load being served")
        out = fleet_cmd(f, "promote", TIER, "v2", "--why", "faster decode")
        assert "v2 is live (was v1)" in out.stdout
        fewest = watch_floor(f, lambda: rolled_to(f, "v2"), 90, "every replica at v2")
        assert fewest >= FLOOR
        wait_until(lambda: '"done_at": null' not in fleet_cmd(f, "models", "show", TIER, "--json").stdout,
                   20, interval=0.3, what="the rollout marked done")
        fewest = min(fewest, watch_floor(f, lambda: True, 1, "-"))

        fleet_cmd(f, "rollback", TIER, "--why", "back to v1")
        fewest = min(fewest, watch_floor(f, lambda: rolled_to(f, "v1"), 90, "every replica back at v1"))
        assert fewest >= FLOOR
    sent = load.sent + len(callers.got)
    wait_until(lambda: f.counters(TIER).get("completed", 0) >= sent, 60, what="every call served")
    c = f.counters(TIER)
    assert (c.get("failed", 0), c.get("expired", 0), c["completed"]) == (0, 0, sent), c
    # What the callers through the gateway saw: every stream whole, none refused or cut.
    assert len(callers.got) >= 10 and all(status == 200 and whole for status, whole in callers.got), callers.got

    ev = events(f)
    starts = [e for e in ev if e.get("event") == "rollout_start"]
    # One at a time, so no more starts than the two rollouts needed (an old replica leaves by the
    # rollout's drain or by the scaler's own scale-in, which takes an old one first).
    assert 2 <= len(starts) <= 2 * FLOOR, starts
    assert [e["reason"] for e in ev if e.get("event") == "rollout_done"] == [
        "promote to v2: every replica runs v2", "rollback to v1: every replica runs v1"]
    hist = [line.split()[2] for line in fleet_cmd(f, "models", "history", TIER).stdout.splitlines()]
    # (v2 may be judged, and kept, if the machine is slow enough for its window to pass first)
    assert [a for a in hist if a != "judged"] == ["seed", "promote", "rollout_done", "rollback", "rollout_done"]


def test_a_standby_finishes_a_rollout_the_leader_left_without_acting_on_it_twice(rfleet: Fleet) -> None:
    f = rfleet
    a = start_scaler(f)
    wait_until(lambda: versions(f) == ["v1", "v1"], 60, what="the floor ready at v1", why=lambda: beats(f))
    b = start_scaler(f)
    leader = f.r.get(scaler_leader_key(f.namespace))
    fleet_cmd(f, "promote", TIER, "v2")
    # The leader starts the first new replica; it dies in the middle of the rollout.
    wait_until(lambda: any(e.get("event") == "rollout_start" for e in events(f)), 30, what="the rollout begun")
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    wait_until(lambda: f.r.get(scaler_leader_key(f.namespace)) not in (None, leader), 20,
               what="the standby holding the lease")
    wait_until(lambda: rolled_to(f, "v2"), 90, what="every replica at v2", why=lambda: beats(f))
    wait_until(lambda: any(e.get("event") == "rollout_done" for e in events(f)), 20, what="the rollout done")
    ev = events(f)
    assert len([e for e in ev if e.get("event") == "rollout_done"]) == 1
    # Adopted, not restarted: the new leader started only what was still to replace, so the tier
    # ends at its floor, and no replica was started at v2 beyond the two old ones it replaced.
    starts = [e for e in ev if e.get("event") == "rollout_start"]
    assert len(starts) == FLOOR, starts
    assert len(beats(f)) == FLOOR
    b.send_signal(signal.SIGTERM)
    b.wait(60)


def test_the_registry_survives_a_restart_of_every_part(rfleet: Fleet) -> None:
    f = rfleet
    fleet_cmd(f, "promote", TIER, "v2", "--why", "before the restart")
    s = start_scaler(f)
    wait_until(lambda: versions(f) == ["v2", "v2"], 60, what="the floor ready at v2, the registry's",
               why=lambda: beats(f))
    s.send_signal(signal.SIGTERM)
    s.wait(60)
    wait_until(lambda: not beats(f), 30, what="every replica drained", why=lambda: beats(f))
    # The scaler again, from the same config (which names v1 as its own): v2 is still live.
    s = start_scaler(f)
    wait_until(lambda: versions(f) == ["v2", "v2"], 60, what="the floor ready at v2 again", why=lambda: beats(f))
    rid = f.start_worker(TIER)  # a worker started by hand runs the live version too
    assert beats(f)[rid]["version"] == "v2"
    out = fleet_cmd(f, "models", "show", TIER).stdout
    assert "live v2, previous v1" in out
    hist = fleet_cmd(f, "models", "history", TIER).stdout
    assert hist.count("promote") == 1 and "before the restart" in hist

    f.kill_worker(rid, signal.SIGTERM)
    wait_until(lambda: versions(f) == ["v2", "v2"] and len(beats(f)) == 2, 60, what="back to the floor at v2",
               why=lambda: beats(f))
    # Shown everywhere, and the same after the gateway restarts: status, `fleet status`, metrics.
    for _ in range(2):
        gw = f.start_gateway().procs[-1]
        admin = {"authorization": "Bearer sk-admin"}
        doc = httpx.get(f"{f.base_url}/v1/fleet/status", headers=admin, timeout=10).json()["tiers"][TIER]
        assert doc["model"]["live"] == "v2" and doc["model"]["previous"] == "v1"
        assert doc["versions"]["v2"]["ready"] == 2 and {r["version"] for r in doc["replica_detail"]} == {"v2"}
        table = fleet_cmd(f, "status", "--url", f.base_url, "--api-key", "sk-admin").stdout
        assert "v2" in table
        metrics = httpx.get(f"{f.base_url}/metrics", headers=admin, timeout=10).text
        assert 'fleet_replicas{state="ready",tier="routing",version="v2"} 2.0' in metrics
        gw.send_signal(signal.SIGTERM)
        gw.wait(30)


def test_the_previous_version_stays_warm_and_a_rollback_within_the_grace_resumes_it(rfleet: Fleet,
                                                                                   tmp_path: Path) -> None:
    f = rfleet
    f.config_path = config_variant(CONFIG, tmp_path, TIER, "rollout", warm_grace_s=8)
    start_scaler(f)
    wait_until(lambda: versions(f) == ["v1", "v1"], 60, what="the floor ready at v1", why=lambda: beats(f))
    old = {rid for rid, b in beats(f).items() if b["state"] == "ready"}
    with Load(f) as load:
        fleet_cmd(f, "promote", TIER, "v2")
        # Replaced, but up: the v1 replicas claim nothing and say draining.
        wait_until(lambda: versions(f) == ["v2", "v2"] and versions(f, "draining") == ["v1", "v1"], 60,
                   what="v2 serving, v1 parked warm")
        assert {rid for rid, b in beats(f).items() if b["version"] == "v1"} == old
        t_back = time.time()
        fleet_cmd(f, "rollback", TIER)
        wait_until(lambda: {rid for rid, b in beats(f).items() if b["state"] == "ready" and b["version"] == "v1"}
                   == old, 30, what="the same v1 replicas serving again")
        # No cold start: nothing was started for the way back, the parked ones were resumed.
        back = [e for e in events(f) if float(e["at"]) >= t_back]
        assert not [e for e in back if e.get("event") == "rollout_start"], back
        assert sorted(e["replica"] for e in back if e.get("event") == "rollout_resume") == sorted(old)
        wait_until(lambda: rolled_to(f, "v1"), 60, what="v2 drained after the rollback")

        # Promoted again and left alone: past the grace, the parked replicas are stopped.
        fleet_cmd(f, "promote", TIER, "v2")
        wait_until(lambda: versions(f) == ["v2", "v2"], 60, what="v2 serving", why=lambda: beats(f))
        wait_until(lambda: rolled_to(f, "v2"), 40, what="the parked v1 replicas gone after the grace")
        over = [e for e in events(f) if e.get("event") == "warm_grace_over"]
        assert sorted(e["replica"] for e in over) == sorted(old)
    sent = load.sent
    wait_until(lambda: f.counters(TIER).get("completed", 0) >= sent, 60, what="every call served")
    c = f.counters(TIER)
    assert (c.get("failed", 0), c.get("expired", 0), c["completed"]) == (0, 0, sent), c


def test_a_slow_canary_is_rolled_back_automatically_with_its_reason(rfleet: Fleet) -> None:
    """v3's first token takes several times v1's: promoted as a canary of one under load, it is
    judged on TTFT p99 against v1, undone by the scaler, and every replica ends at v1."""
    f = rfleet
    port = free_port()
    start_scaler(f, port)
    wait_until(lambda: versions(f) == ["v1", "v1"], 60, what="the floor ready at v1", why=lambda: beats(f))
    with Load(f) as load:
        wait_until(lambda: f.counters(TIER).get("completed", 0) >= 20, 30, what="v1 measured under load")
        fleet_cmd(f, "promote", TIER, "v3", "--canary", "1", "--why", "try v3")
        most_v3 = 0
        end = time.monotonic() + 60
        while not any(e.get("event") == "auto_rollback" for e in events(f)):
            assert time.monotonic() < end, events(f)
            most_v3 = max(most_v3, sum(1 for b in beats(f).values()
                                       if b["version"] == "v3" and b["state"] != "draining"))
            time.sleep(0.05)
        assert most_v3 == 1  # the canary: one replica on trial, the rest stayed at v1
        wait_until(lambda: rolled_to(f, "v1"), 60, what="every replica back at v1")
    sent = load.sent
    wait_until(lambda: f.counters(TIER).get("completed", 0) >= sent, 60, what="every call served")
    c = f.counters(TIER)
    assert (c.get("failed", 0), c.get("expired", 0)) == (0, 0), c

    (why,) = [e["reason"] for e in events(f) if e.get("event") == "auto_rollback"]
    assert why.startswith("v3 -> v1: TTFT p99 ") and "x 3" in why, why
    show = fleet_cmd(f, "models", "show", TIER).stdout
    assert "live v1" in show and "auto_rollback v3 -> v1" in show
    hist = fleet_cmd(f, "models", "history", TIER).stdout.splitlines()
    auto = [line for line in hist if " auto_rollback " in line]
    assert len(auto) == 1 and "automatic: v3 is worse: TTFT p99" in auto[0] and "by scaler-" in auto[0]
    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'fleet_model_rollbacks_total{reason="ttft_p99",tier="routing"} 1.0' in scraped
    assert 'fleet_replicas{state="ready",tier="routing",version="v1"}' in scraped


def test_scaling_goes_on_during_a_rollout_and_counts_both_versions(rfleet: Fleet) -> None:
    """A burst while a canary is judged: the scaler scales out as it would otherwise, counting the
    replicas of both versions, and every replica it adds runs the live (new) version."""
    f = rfleet
    start_scaler(f)
    wait_until(lambda: versions(f) == ["v1", "v1"], 60, what="the floor ready at v1", why=lambda: beats(f))
    fleet_cmd(f, "promote", TIER, "v2", "--canary", "1")
    wait_until(lambda: versions(f) == ["v1", "v1", "v2"], 60, what="the canary ready beside v1", why=lambda: beats(f))
    before = set(beats(f))
    # The scaler counts the three, of both versions, as its ready replicas.
    wait_until(lambda: f.r.hget(f.keys(TIER).scaler, "ready") == b"3", 10, what="3 ready counted")
    t_burst = time.time()

    async def burst() -> None:
        r = Redis.from_url(f.redis_url)
        line = Line(r, f.namespace, TIER, rate_window_s=4.0)
        payload = call_payload(max_tokens=20)
        await asyncio.gather(*(line.enqueue(uuid.uuid4().hex, Priority.interactive, payload, 60_000)
                               for _ in range(80)))
        await r.aclose()

    asyncio.run(burst())
    added: dict[str, str] = {}
    end = time.monotonic() + 90
    while f.counters(TIER).get("completed", 0) < 80:
        assert time.monotonic() < end, "the burst was not served"
        added.update({rid: b["version"] for rid, b in beats(f).items() if rid not in before})
        time.sleep(0.05)
    outs = [e for e in events(f) if e.get("action") == "scale_out" and float(e["at"]) >= t_burst]
    assert outs, events(f)
    assert added and set(added.values()) == {"v2"}, added  # what it adds runs the live version
    c = f.counters(TIER)
    assert (c.get("failed", 0), c.get("expired", 0)) == (0, 0), c
