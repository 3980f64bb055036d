"""What it costs a call that its enqueue waits for a replica (`WAIT 1`, `replication:` in the config).

A private redis-server with one replica (`--replicaof`, on loopback), a gateway and a
zero-latency sim worker; the same calls with the acknowledgement off (`ack_replicas: 0`, the
baseline) and on, in alternating rounds (the gateway restarted for each), so a busy box moves
both alike:

- latency per call at concurrency 1, p50 and p99 (what WAIT adds to every call: a round trip to
  the replica);
- calls/s and the master's CPU per call at concurrency 32.

    .venv/bin/python bench/replica_ack.py [--calls 1000] [--rounds 2] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_config, fleet_env, fleetctl, pct, stop, zero_tier  # noqa: E402
from bench.redis_ops import load, redis_cpu, settle  # noqa: E402
from fleet.redis_server import PrivateRedis, free_port  # noqa: E402

BODY = orjson.dumps({"model": "routing", "messages": [{"role": "user", "content": "classify this"}],
                     "max_tokens": 16, "ignore_eos": True})  # exactly 16 tokens each (vLLM's extension)


async def latencies(url: str, calls: int) -> list[float]:
    """Seconds per call, one after another."""
    out = []
    async with aiohttp.ClientSession() as c:
        for _ in range(calls):
            t0 = time.perf_counter()
            async with c.post(url, data=BODY, headers={"content-type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{r.status}")
            out.append(time.perf_counter() - t0)
    return out


def phase(master: PrivateRedis, ack: int, calls: int, conc: int) -> tuple[list[float], float, float]:
    """One round with `ack_replicas` = ack: (latencies at C=1, calls/s at `conc`, master CPU ms a call)."""
    env = {**fleet_env(bench_config(zero_tier("routing")), master.url), "FLEET_REPLICATION__ACK_REPLICAS": str(ack)}
    port = free_port()
    gw = fleetctl("gateway", "--port", str(port), env=env)
    wk = fleetctl("worker", "--tier", "routing", env=env)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    node = [redis.Redis.from_url(master.url)]
    try:
        end = time.monotonic() + 60
        while True:
            try:
                asyncio.run(load(url, 50, 4, 16, False))  # warm-up, and the parts are ready
                break
            except (aiohttp.ClientError, RuntimeError):
                if time.monotonic() > end:
                    raise
                time.sleep(0.3)
        lat = asyncio.run(latencies(url, calls))
        c0 = sum(redis_cpu(node))
        wall = asyncio.run(load(url, calls, conc, 16, False))
        cpu_ms = (sum(redis_cpu(node)) - c0) / calls * 1e3
        return lat, calls / wall, cpu_ms
    finally:
        stop((gw, wk), wait_s=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    master = PrivateRedis().start()
    replica = PrivateRedis(replica_of=master.port).start()
    try:
        r = redis.Redis(port=replica.port)
        settle(r, "the replica in sync", lambda: r.info("replication").get("master_link_status") == "up")
        got: dict[int, list[tuple[list[float], float, float]]] = {0: [], 1: []}
        for _ in range(a.rounds):
            for ack in (0, 1):
                got[ack].append(phase(master, ack, a.calls, a.concurrency))
    finally:
        replica.stop()
        master.stop()
    print(f"replica acknowledgement (WAIT 1) off vs on: {a.rounds} rounds of {a.calls} calls each way, "
          "one master and one replica on loopback")
    print(f"{'':<6}{'p50 ms C=1':>12}{'p99 ms C=1':>12}{f'calls/s C={a.concurrency}':>16}{'Redis CPU ms':>14}")
    rows = {}
    for ack, name in ((0, "off"), (1, "on")):
        lat = [x for lats, _, _ in got[ack] for x in lats]
        rows[ack] = (statistics.median(lat) * 1e3, pct(lat, 0.99) * 1e3,
                     statistics.median(t for _, t, _ in got[ack]), statistics.median(c for _, _, c in got[ack]))
        print(f"{name:<6}{rows[ack][0]:>12.2f}{rows[ack][1]:>12.2f}{rows[ack][2]:>16.0f}{rows[ack][3]:>14.3f}")
    print(f"on - off: {rows[1][0] - rows[0][0]:+.2f} ms p50 a call ({rows[1][0] / rows[0][0]:.2f}x), "
          f"{rows[1][2] / rows[0][2]:.2f}x the calls/s, {rows[1][3] / rows[0][3]:.2f}x the Redis CPU")


if __name__ == "__main__":
    main()
