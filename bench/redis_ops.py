"""What one call costs Redis, the gateway and the worker: the figures of docs/scale-out.md.

Runs a gateway and a worker (sim engine, zero latency) against a private
redis-server, sends N non-streaming calls (and N streaming ones), and reads
from before to after each run:

- Redis's INFO commandstats: commands per call, by command (a Lua script is
  one EVALSHA; the commands it runs inside are counted under their own names
  too, so both are shown);
- Redis's INFO cpu: Redis CPU seconds per call, so calls/s one shard (one
  single-threaded redis-server) can carry = 1 / that;
- the gateway's and the worker's CPU seconds (/proc/PID/stat): calls/s one
  gateway core can carry = 1 / gateway CPU per call.

    .venv/bin/python bench/redis_ops.py [--calls 2000] [--concurrency 32] [--tokens 16] [--cluster]
        [--prompt-kb 1,8,50] [--held 100]

Then what a call keeps in Redis, by prompt size: `--held` calls of each size join a tier no
worker serves yet (MEMORY USAGE summed over the namespace's keys, less what it held before:
bytes per call in flight), then a worker serves them and the result streams are read and dropped
(bytes per finished call, held for `result_ttl_s`). Each figure is also shown as a ratio to the
prompt's own size, the baseline of the same run.

--cluster runs the same on a private Redis Cluster (3 masters + 3 replicas,
`redis+cluster://`), summing every master's figures and showing how the
Redis CPU spread over the shards.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_config, cpu_s, fleet_env, fleetctl, stop, zero_tier  # noqa: E402
from fleet.redis_server import PrivateRedis, free_port  # noqa: E402
from fleet.store.connection import connect_sync  # noqa: E402
from tests.harness import redis_bytes  # noqa: E402

# `parked` has no worker until the footprint run starts one: its calls wait in the line meanwhile.
ZERO_FLEET = bench_config(zero_tier("routing"), zero_tier("parked"))
NAMESPACE = "bench"

# Commands Lua scripts run inside; shown apart from what the parts send themselves.
IN_SCRIPTS = {"time", "incr", "hset", "hmget", "hget", "pexpire", "expire", "zadd", "zrem", "zpopmin", "lpush",
              "ltrim", "hincrby", "zremrangebyscore", "zcount", "zrangebyscore", "zcard", "hgetall", "xadd",
              "publish", "hsetnx", "hdel", "get", "set", "del", "pttl", "zrange", "exists"}


def commandstats(nodes: list[redis.Redis]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in nodes:
        for k, v in r.info("commandstats").items():
            out[k.removeprefix("cmdstat_")] = out.get(k.removeprefix("cmdstat_"), 0) + int(v["calls"])
    return out


def redis_cpu(nodes: list[redis.Redis]) -> list[float]:
    """CPU seconds of each node."""
    return [float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in (r.info("cpu") for r in nodes)]


async def load(url: str, calls: int, concurrency: int, tokens: int, stream: bool, *, model: str = "routing",
               content: str = "classify this") -> float:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                         "max_tokens": tokens, "stream": stream, "ignore_eos": True})  # exactly `tokens` each
    left = calls
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as c:
        async def user() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with c.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{resp.status}: {data[:200]!r}")

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return time.perf_counter() - t0


def measure(r: list[redis.Redis], gw: int, wk: int, url: str, calls: int, conc: int, tokens: int,
            stream: bool) -> None:
    s0, n0, g0, w0 = commandstats(r), redis_cpu(r), cpu_s(gw), cpu_s(wk)
    wall = asyncio.run(load(url, calls, conc, tokens, stream))
    s1, n1, g1, w1 = commandstats(r), redis_cpu(r), cpu_s(gw), cpu_s(wk)
    c0, c1 = sum(n0), sum(n1)
    d = {k: (v - s0.get(k, 0)) / calls for k, v in s1.items() if v - s0.get(k, 0) > 0}
    sent = {k: v for k, v in d.items() if k not in IN_SCRIPTS and k not in ("info",)}
    inner = {k: v for k, v in d.items() if k in IN_SCRIPTS}
    redis_ms, gw_ms, wk_ms = (c1 - c0) / calls * 1e3, (g1 - g0) / calls * 1e3, (w1 - w0) / calls * 1e3
    print(f"\n{'streaming' if stream else 'non-streaming'} calls: {calls} at concurrency {conc}, {tokens} tokens, "
          f"{calls / wall:.0f} calls/s on this box")
    print(f"  commands the parts send, per call: {sum(sent.values()):.1f}  "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(sent.items(), key=lambda kv: -kv[1])))
    print(f"  commands run inside scripts, per call: {sum(inner.values()):.1f}  "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(inner.items(), key=lambda kv: -kv[1])))
    print(f"  CPU per call: Redis {redis_ms:.3f} ms, gateway {gw_ms:.3f} ms, worker {wk_ms:.3f} ms")
    if len(r) > 1:
        share = [(b - a) / max(c1 - c0, 1e-9) for a, b in zip(n0, n1, strict=True)]
        print("  Redis CPU by shard: " + ", ".join(f"{s:.0%}" for s in share)
              + " (a tier's keys share one slot, so one tier's line lives on one shard)")
    print(f"  => one Redis shard (one core) carries ~{1e3 / redis_ms:.0f} calls/s; "
          f"one gateway core ~{1e3 / gw_ms:.0f} calls/s; one worker process (sim, no model) ~{1e3 / wk_ms:.0f}")


def settle(r: redis.Redis, what: str, done: object, limit_s: float = 60) -> None:
    """Wait until `done()` holds (bounded)."""
    end = time.monotonic() + limit_s
    while not done():  # type: ignore[operator]
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def held_calls(r: redis.Redis, env: dict[str, str], url: str, keys: str, content: str, held: int,
                     before: int) -> float:
    """`held` calls of `content` join the parked tier; bytes per call while they wait; then a worker
    serves them all (and is stopped)."""
    line = keys.replace("*", "line")
    task = asyncio.ensure_future(load(url, held, held, 4, False, model="parked", content=content))
    await asyncio.to_thread(settle, r, "every call in the line", lambda: r.zcard(line) >= held)
    in_flight = (await asyncio.to_thread(redis_bytes, r, keys) - before) / held
    worker = fleetctl("worker", "--tier", "parked", env=env)
    try:
        await task
    finally:
        stop((worker,))
    return in_flight


def footprint(r: redis.Redis, env: dict[str, str], url: str, sizes_kb: list[int], held: int) -> None:
    """Bytes per call in Redis while in flight and once finished, for each prompt size (see the doc)."""
    keys = f"{NAMESPACE}:{{parked}}:*"  # the tier's own keys: what the other runs left does not blur it
    print(f"\nwhat a call keeps in Redis ({held} calls a size; MEMORY USAGE over the tier's keys)")
    for kb in sizes_kb:
        content = "x" * (kb * 1024)
        before, req_before = redis_bytes(r, keys), redis_bytes(r, keys.replace("*", "req:*"))
        in_flight = asyncio.run(held_calls(r, env, url, keys, content, held, before))
        # (the gateway's own wake stream, `res:~gw-...`, stays: it is no call's)
        settle(r, "the result streams dropped",
               lambda: all(b"~gw-" in k for k in r.scan_iter(match=keys.replace("*", "res:*"))))
        finished = (redis_bytes(r, keys) - before) / held
        record = (redis_bytes(r, keys.replace("*", "req:*")) - req_before) / held
        print(f"  prompt {kb:>3} KB: in flight {in_flight:8.0f} B a call ({in_flight / len(content):.2f}x the prompt), "
              f"finished {finished:6.0f} B a call ({finished / len(content):.3f}x the prompt; the request's record "
              f"{record:.0f} B, kept result_ttl_s, the rest rate-window sets, kept rate_window_s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--cluster", action="store_true", help="on a private Redis Cluster instead of one server")
    ap.add_argument("--prompt-kb", default="1,8,50", help="prompt sizes for what a call keeps in Redis ('' skips)")
    ap.add_argument("--held", type=int, default=100, help="calls of each prompt size held in the line")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # (timeout's SIGTERM) still stop what was started
    if args.cluster:
        from tests.cluster_harness import PrivateCluster

        server: PrivateRedis | PrivateCluster = PrivateCluster().start()
        nodes = [n.client() for n in server.nodes if server.roles().get(n.port) == "master"]
    else:
        server = PrivateRedis().start()
        nodes = [redis.Redis.from_url(server.url)]
    env = fleet_env(ZERO_FLEET, server.url)
    port = free_port()
    gw = fleetctl("gateway", "--port", str(port), env=env)
    wk = fleetctl("worker", "--tier", "routing", env=env)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        end = time.monotonic() + 60
        while True:
            try:
                asyncio.run(load(url, 50, 4, args.tokens, False))  # warm-up, and the parts are ready
                break
            except (aiohttp.ClientError, RuntimeError):
                if time.monotonic() > end:
                    raise
                time.sleep(0.3)
        # Idle cost (heartbeats, the gateway's views) over the run is included: it is what a
        # deployment pays too, and at these rates it is small beside the calls.
        measure(nodes, gw.pid, wk.pid, url, args.calls, args.concurrency, args.tokens, stream=False)
        measure(nodes, gw.pid, wk.pid, url, args.calls, args.concurrency, args.tokens, stream=True)
        if args.prompt_kb:
            footprint(connect_sync(server.url), env, url,
                      [int(x) for x in args.prompt_kb.split(",")], args.held)
    finally:
        stop((gw, wk), wait_s=30)
        server.stop()


if __name__ == "__main__":
    main()
