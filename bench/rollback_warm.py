"""What keeping the replaced version warm buys: a rollback within `rollout.warm_grace_s`
(the parked replicas resume) against the same rollback with no grace (new replicas
cold-start), in the same run, on the same machine.

A private Redis, `fleet scaler` with the local backend and sim workers (tests/fleet-rollout.yaml:
a floor of 2, v1 and v2 sim profiles). For each mode: promote v2, wait until every replica runs
it, roll back, and time the rollback from the command to every live replica at v1 and ready.

    .venv/bin/python bench/rollback_warm.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

from fleet.redis_server import PrivateRedis
from fleet.store.keys import TierKeys

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "fleet-rollout.yaml"
TIER = "routing"


def _beats(r: redis.Redis, ns: str) -> list[dict[str, Any]]:
    now = time.time()
    return [b for b in (orjson.loads(v) for v in r.hvals(TierKeys(ns, TIER).replicas)) if now - b["ts"] < 5]


def _at(r: redis.Redis, ns: str, version: str) -> bool:
    b = _beats(r, ns)
    return sum(x["state"] == "ready" for x in b) >= 2 and all(x["version"] == version for x in b)


def _wait(pred: Any, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"timed out after {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def one_mode(url: str, grace_s: float, rounds: int) -> list[float]:
    """Rollback times (s) with the given warm grace."""
    raw = yaml.safe_load(CONFIG.read_text())
    raw["tiers"][TIER]["rollout"].update(warm_grace_s=grace_s, judge_window_s=3600)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(raw, fh)
    ns = f"b{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "REDIS_URL": url, "FLEET_CONFIG": fh.name, "FLEET_NAMESPACE": ns,
           "PYTHONPATH": str(ROOT)}
    fleet = [sys.executable, "-m", "fleetctl"]
    scaler = subprocess.Popen([*fleet, "scaler", "--tick", "0.25", "--metrics-port", "0", "--stop-replicas-on-exit"],
                              env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    r = redis.Redis.from_url(url)
    times = []
    try:
        _wait(lambda: _at(r, ns, "v1"), 60)
        for _ in range(rounds):
            subprocess.run([*fleet, "promote", TIER, "v2"], env=env, cwd=ROOT, check=True, capture_output=True)
            # Every v2 replica ready, the v1 ones parked (with a grace) or gone (without).
            _wait(lambda: sorted(b["version"] for b in _beats(r, ns) if b["state"] == "ready") == ["v2", "v2"], 90)
            t0 = time.monotonic()
            subprocess.run([*fleet, "rollback", TIER], env=env, cwd=ROOT, check=True, capture_output=True)
            _wait(lambda: sorted(b["version"] for b in _beats(r, ns) if b["state"] == "ready") == ["v1", "v1"], 90)
            times.append(time.monotonic() - t0)
            _wait(lambda: _at(r, ns, "v1"), 90)  # the v2 replicas drained before the next round
    finally:
        scaler.send_signal(signal.SIGTERM)
        scaler.wait(90)
        os.unlink(fh.name)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    server = PrivateRedis().start()
    try:
        warm = one_mode(server.url, 600.0, args.rounds)
        cold = one_mode(server.url, 0.0, args.rounds)
    finally:
        server.stop()
    w, c = statistics.median(warm), statistics.median(cold)
    print(f"rollback to v1, every replica ready (median of {args.rounds}):")
    print(f"  warm (parked replicas resumed): {w:.2f} s  {[round(x, 2) for x in warm]}")
    print(f"  cold (new replicas started):    {c:.2f} s  {[round(x, 2) for x in cold]}")
    print(f"  warm / cold: {w / c:.2f}")


if __name__ == "__main__":
    main()
