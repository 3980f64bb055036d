"""What the gateway adds: the same load straight to a zero-latency engine, and
through gateway -> Redis line -> worker (sim engine with a zero-latency profile).

Both run in this one process's event loop as the client, against servers
started here, so the machine's noise hits both alike; the ratio is the figure.

    .venv/bin/python bench/gateway_overhead.py [--requests 2000] [--tokens 16] [--gateways]

--gateways then also compares 1 and 2 gateway processes on one port
(`fleet gateway --workers N`) in front of the same worker and Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.redis_server import PrivateRedis, free_port  # noqa: E402

ZERO_FLEET = """
namespace: bench
heartbeat_s: 1.0
tiers:
  routing:
    warm_floor: 1
    max_replicas: 1
    slots: 128
    sim:
      weights_gb: 0
      load_gb_s: 1
      warmup_s: 0
      prefill_tokens_per_s: 1.0e12
      decode_step: {base_s: 0, per_seq_s: 0}
      kv_capacity_tokens: 10000000
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _wait_http(url: str, limit_s: float = 30) -> None:
    end = time.monotonic() + limit_s
    async with httpx.AsyncClient() as c:
        while time.monotonic() < end:
            try:
                await c.post(url, json={"model": "routing", "messages": [{"role": "user", "content": "w"}],
                                        "max_tokens": 1}, timeout=2)
                return
            except httpx.HTTPError:
                await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not answer")


async def load(url: str, concurrency: int, total: int, tokens: int) -> tuple[list[float], float]:
    # aiohttp, not httpx: at 64 concurrent callers httpx's own CPU cost would be
    # what is measured on 2 cores.
    body = orjson.dumps({"model": "routing", "messages": [{"role": "user", "content": "classify this"}],
                         "max_tokens": tokens})
    headers = {"content-type": "application/json"}
    lat: list[float] = []
    left = total
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as c:
        async def user() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                async with c.post(url, data=body, headers=headers) as r:
                    data = await r.read()
                lat.append(time.perf_counter() - t0)
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {data[:200]!r}")

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return lat, time.perf_counter() - t0


async def measure(direct: str, gateway: str, requests: int, tokens: int) -> None:
    await _wait_http(direct)
    await _wait_http(gateway)
    print(f"{'path':<10}{'conc':>6}{'req':>7}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}")
    rows = {}
    for conc in (1, 64):
        n = max(200, requests // (8 if conc == 1 else 1))
        for name, url in (("direct", direct), ("gateway", gateway)):
            await load(url, conc, min(100, n), tokens)  # warm-up
            lat, wall = await load(url, conc, n, tokens)
            rows[(name, conc)] = (pct(lat, 0.5), pct(lat, 0.99), n / wall)
            p50, p99, rps = rows[(name, conc)]
            print(f"{name:<10}{conc:>6}{n:>7}{p50 * 1e3:>10.2f}{p99 * 1e3:>10.2f}{rps:>10.1f}")
    print()
    for conc in (1, 64):
        d, g = rows[("direct", conc)], rows[("gateway", conc)]
        print(f"concurrency {conc:>2}: gateway adds p50 {(g[0] - d[0]) * 1e3:+.2f} ms, "
              f"p99 {(g[1] - d[1]) * 1e3:+.2f} ms; throughput {g[2]:.0f} vs {d[2]:.0f} req/s direct "
              f"(ratio {g[2] / d[2]:.2f})")


def compare_gateways(env: dict[str, str], requests: int, tokens: int, concurrency: int = 64) -> None:
    """Throughput through `fleet gateway --workers 1`, then `--workers 2`, each on a fresh
    port in front of the same worker; the ratio is the figure (on a box with fewer free
    cores than processes, it is capped by the cores, not the gateway)."""
    rows = {}
    for n in (1, 2):
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        p = subprocess.Popen([sys.executable, "-m", "fleetctl", "gateway", "--port", str(port), "--workers", str(n)],
                             env=env, cwd=ROOT)
        try:
            asyncio.run(_wait_http(url))
            asyncio.run(load(url, concurrency, min(200, requests), tokens))  # warm-up, every process
            lat, wall = asyncio.run(load(url, concurrency, requests, tokens))
            rows[n] = (pct(lat, 0.5), pct(lat, 0.99), requests / wall)
        finally:
            p.terminate()
            p.wait(45)
    print(f"\n{'gateways':<10}{'conc':>6}{'req':>7}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}")
    for n, (p50, p99, rps) in rows.items():
        print(f"{n:<10}{concurrency:>6}{requests:>7}{p50 * 1e3:>10.2f}{p99 * 1e3:>10.2f}{rps:>10.1f}")
    print(f"2 gateway processes vs 1: throughput ratio {rows[2][2] / rows[1][2]:.2f} "
          f"(cores on this box: {os.cpu_count()})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--gateways", action="store_true", help="also compare 1 and 2 gateway processes")
    args = ap.parse_args()

    redis = PrivateRedis().start()
    cfg = Path(tempfile.mkdtemp()) / "fleet.yaml"
    cfg.write_text(ZERO_FLEET)
    env = {**os.environ, "REDIS_URL": redis.url, "FLEET_CONFIG": str(cfg)}
    gw_port, mock_port = free_port(), free_port()
    py = sys.executable
    procs = [
        subprocess.Popen([py, "-m", "fleetctl", "gateway", "--port", str(gw_port)], env=env, cwd=ROOT),
        subprocess.Popen([py, "-m", "fleetctl", "worker", "--tier", "routing"], env=env, cwd=ROOT),
        subprocess.Popen([py, str(ROOT / "bench" / "mock_upstream.py"), str(mock_port)], env=env, cwd=ROOT),
    ]
    try:
        asyncio.run(measure(f"http://127.0.0.1:{mock_port}/v1/chat/completions",
                            f"http://127.0.0.1:{gw_port}/v1/chat/completions", args.requests, args.tokens))
        if args.gateways:
            compare_gateways(env, args.requests, args.tokens)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        redis.stop()


if __name__ == "__main__":
    main()
