"""A rollout with the docker backend: the compose stack (scaler in its container) runs one sim tier
in worker containers at v1 (tests/fleet-containers-rollout.yaml, floor 2); `fleet promote` under a
light load replaces every worker container with one at v2 (its label and its heartbeats say so),
with 0 failed calls and the ready never below the floor; `fleet rollback` brings them back to v1.
The rollout with local processes, and its other cases, are in tests/processes/test_model_rollout.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.docker_stack import LABEL, ROOT, Stack, start_stack
from tests.harness import LineLoad, wait_until
from tests.paths import TESTS

pytestmark = pytest.mark.timeout(900)  # a cold image build costs about 5 minutes
CONFIG = TESTS / "fleet-containers-rollout.yaml"
TIER = "routing"
FLOOR = 2


@pytest.fixture
def stack() -> Iterator[Stack]:
    # Under the checkout, not /tmp/pytest-of-root: the worker containers run as uid 1000 and read it.
    tmp = ROOT / ".docker" / f"stack-{uuid.uuid4().hex[:8]}"
    s = start_stack(tmp, CONFIG)
    try:
        yield s
    finally:
        s.down()
        shutil.rmtree(tmp, ignore_errors=True)


def fleet_cmd(s: Stack, *args: str) -> str:
    env = {**s.env, "REDIS_URL": s.redis_url, "FLEET_CONFIG": f"{s.env['FLEET_CONFIG_DIR']}/fleet.yaml"}
    out = subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def state(s: Stack) -> dict[str, object]:
    """What a failed wait shows: each worker container's version label and state, each heartbeat."""
    return {"containers": {rid: (c["Labels"].get(f"{LABEL}.version"), c["State"])
                           for rid, c in s.workers(TIER, all_states=True).items()},
            "beats": {rid: (b["version"], b["state"]) for rid, b in s.heartbeats(TIER).items()}}


def ready_versions(s: Stack) -> list[str]:
    return sorted(b["version"] for b in s.heartbeats(TIER).values() if b["state"] == "ready")


def rolled_to(s: Stack, version: str) -> bool:
    """Every running worker container is labelled `version`, every live heartbeat says it, the
    drained ones have gone, and the floor is ready."""
    running = s.workers(TIER)
    beats = s.heartbeats(TIER)
    return (len(ready_versions(s)) >= FLOOR and set(running) == set(beats)
            and all(c["Labels"].get(f"{LABEL}.version") == version for c in running.values())
            and all(b["version"] == version for b in beats.values()))


def watch_floor(s: Stack, version: str, timeout: float) -> int:
    """Wait for rolled_to(version), looking at the ready replicas all the while; the fewest seen."""
    fewest = 99
    end = time.monotonic() + timeout
    while not rolled_to(s, version):
        assert time.monotonic() < end, f"timed out after {timeout}s waiting for every worker at {version}: {state(s)}"
        fewest = min(fewest, len(ready_versions(s)))
        time.sleep(0.1)
    return fewest


def Load(s: Stack, rate: float = 3.0) -> LineLoad:
    """A light, steady load on the line (as the gateway would enqueue), 3 a second by default."""
    return LineLoad(s.redis_url, s.namespace, TIER, rate, 120_000)


def test_promote_replaces_every_worker_container_then_rollback_brings_them_back(stack: Stack) -> None:
    s = stack
    wait_until(lambda: rolled_to(s, "v1") and len(s.workers(TIER)) == FLOOR, 180, interval=0.5,
               what="the floor of worker containers ready at v1", why=lambda: state(s))
    t0 = time.time()
    with Load(s) as load:
        wait_until(lambda: s.counters(TIER).get("completed", 0) >= 10, 60, interval=0.3,
                   what="the load being served", why=lambda: s.counters(TIER))
        assert "v2 is live (was v1)" in fleet_cmd(s, "promote", TIER, "v2", "--why", "faster decode")
        fewest = watch_floor(s, "v2", 150)
        wait_until(lambda: '"done_at": null' not in fleet_cmd(s, "models", "show", TIER, "--json"), 30,
                   interval=0.5, what="the promotion's rollout marked done",
                   why=lambda: fleet_cmd(s, "models", "show", TIER))
        v2_ids = set(s.workers(TIER))
        fleet_cmd(s, "rollback", TIER, "--why", "back to v1")
        fewest = min(fewest, watch_floor(s, "v1", 150))
    assert fewest >= FLOOR, f"the ready fell to {fewest}, below the floor {FLOOR}"
    wait_until(lambda: not v2_ids & set(s.workers(TIER, all_states=True)), 60, interval=0.5,
               what="the v2 worker containers removed", why=lambda: state(s))
    sent = load.sent
    wait_until(lambda: s.counters(TIER).get("completed", 0) >= sent, 90, interval=0.3, what="every call served",
               why=lambda: (sent, s.counters(TIER)))
    c = s.counters(TIER)
    assert (c.get("failed", 0), c.get("expired", 0), c["completed"]) == (0, 0, sent), c
    # The rollback's replicas can be all at v1 a tick before the scaler marks its rollout done.
    def done() -> list[str]:
        return [e["reason"] for e in s.decisions(TIER, t0) if e.get("event") == "rollout_done"]

    wait_until(lambda: len(done()) >= 2, 30, interval=0.5, what="the rollback's rollout marked done", why=done)
    assert done() == ["promote to v2: every replica runs v2", "rollback to v1: every replica runs v1"], done()
