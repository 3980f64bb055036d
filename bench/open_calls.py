"""Thousands of open calls through one gateway process: connections, memory, time to first chunk, errors.

`--calls` (5,000) streaming calls are opened over `--ramp-s` seconds against a sim tier
(`slow`) whose replica emits one token every `--token-s` seconds, so each call stays open
for tokens x token-s seconds and, at the peak, all of them are open at once. Meanwhile
probe calls to a zero-latency sim tier (`fast`, its own replica) measure the time to first
chunk the gateway adds under that load, against the same probes on the idle gateway,
measured first in the same run.

Reported: open calls at the peak; Redis connections at the peak (the gateway's, by
client name, and in all); gateway memory per open call (RSS at the peak less RSS idle,
divided by the calls open); time to first chunk of the open calls (it includes up to one
decode step of the sim engine, `--token-s`) and of the probes, p50/p99; errors (any
status but 200, a broken connection, a stream not ending in [DONE]).

Bounded: the whole run stops itself after `--limit-s`. Traffic goes to 127.0.0.1 only.

    .venv/bin/python bench/open_calls.py [--calls 5000] [--ramp-s 30] [--token-s 4] [--tokens 15]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import fleet_env, fleetctl, paced_fleet, pct, raise_fd_limit, stop, zero_tier  # noqa: E402
from fleet.redis_server import PrivateRedis, free_port  # noqa: E402

FLEET = paced_fleet("slow", slots="%(slots)d", step_s="%(token_s)s", tokens="%(tokens)d") + zero_tier("fast", slots=16)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Run:
    def __init__(self, url: str, tokens: int) -> None:
        self.url = url
        self.tokens = tokens
        self.open = 0  # slow calls in flight: sent and not yet ended (waiting for a first chunk or streaming)
        self.streaming = 0  # ... of which past their first chunk
        self.peak = 0
        self.ttfc: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.completed = 0

    async def call(self, s: aiohttp.ClientSession, model: str, tokens: int, ttfc: list[float] | None) -> None:
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hold"}],
                             "max_tokens": tokens, "stream": True, "ignore_eos": True})  # held its whole length
        t0 = time.perf_counter()
        held = model == "slow"  # counted among the open calls
        streaming = False
        if held:
            self.open += 1
            self.peak = max(self.peak, self.open)
        try:
            async with s.post(self.url, data=body, headers={"content-type": "application/json"}) as r:
                if r.status != 200:
                    self.errors[f"HTTP {r.status}: {(await r.read())[:120]!r}"] += 1
                    return
                first = await r.content.readany()
                if ttfc is not None:
                    ttfc.append(time.perf_counter() - t0)
                if held:
                    streaming = True
                    self.streaming += 1
                rest = await r.read()
                if not (first + rest).rstrip().endswith(b"[DONE]") or b'"error"' in rest:
                    self.errors[f"stream ended without [DONE]: {rest[-120:]!r}"] += 1
                else:
                    self.completed += 1
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self.errors[f"{type(e).__name__}: {str(e)[:80]}"] += 1
        finally:
            if held:
                self.open -= 1
            if streaming:
                self.streaming -= 1


async def probes(run: Run, s: aiohttp.ClientSession, n: int, out: list[float]) -> None:
    for _ in range(n):
        await run.call(s, "fast", 4, out)
        await asyncio.sleep(0.05)


async def main_async(args: argparse.Namespace, url: str, gw_pid: int, r: redis.Redis) -> None:
    run = Run(url, args.tokens)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=args.limit_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        # Warm-up and the idle baseline: probes alone.
        for model in ("fast", "slow"):
            end = time.monotonic() + 60
            while time.monotonic() < end:
                n_err = sum(run.errors.values())
                await run.call(s, model, 1, None)
                if sum(run.errors.values()) == n_err:
                    break
                await asyncio.sleep(0.5)
        run.errors.clear()
        idle: list[float] = []
        await probes(run, s, 100, idle)
        rss0 = rss_kb(gw_pid)

        calls: list[asyncio.Task[None]] = []
        t0 = time.monotonic()
        for i in range(args.calls):  # open them over the ramp
            calls.append(asyncio.create_task(run.call(s, "slow", args.tokens, run.ttfc)))
            ahead = t0 + args.ramp_s * (i + 1) / args.calls - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
        # The peak: every call opened and most still streaming.
        # A poll with a deadline (the calls are many tasks; none owns an event to set).
        while run.open < args.calls * 0.98 and time.monotonic() - t0 < args.ramp_s + args.token_s * 3:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        peak_open, peak_streaming = run.open, run.streaming
        rss1 = rss_kb(gw_pid)
        clients = r.client_list()
        by_name = collections.Counter(c.get("name") or "(unnamed)" for c in clients)
        loaded: list[float] = []
        await probes(run, s, 100, loaded)
        await asyncio.wait(calls, timeout=max(1.0, args.limit_s - (time.monotonic() - t0)))
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        unfinished = sum(1 for c in calls if c.cancelled())

    gw_conns = sum(n for name, n in by_name.items() if str(name).startswith("gateway"))
    print(f"calls {args.calls} over {args.ramp_s:g} s, a token every {args.token_s:g} s, {args.tokens} tokens each")
    print(f"open at the peak: {peak_open}, {peak_streaming} of them streaming (most open ever {run.peak}); "
          f"completed {run.completed}; "
          f"cut at the time limit {unfinished}")
    print(f"Redis connections at the peak: gateway {gw_conns} "
          f"({', '.join(f'{k}={v}' for k, v in sorted(by_name.items(), key=str))}), all {len(clients)}")
    print(f"gateway RSS idle {rss0 / 1024:.0f} MiB, at the peak {rss1 / 1024:.0f} MiB: "
          f"{(rss1 - rss0) / max(1, peak_open):.1f} KiB per open call")
    print(f"open calls' time to first chunk (includes up to one {args.token_s:g} s decode step): "
          f"p50 {pct(run.ttfc, 0.5) * 1e3:.0f} ms, p99 {pct(run.ttfc, 0.99) * 1e3:.0f} ms")
    print(f"probe time to first chunk, idle gateway: p50 {pct(idle, 0.5) * 1e3:.2f} ms, "
          f"p99 {pct(idle, 0.99) * 1e3:.2f} ms")
    added50, added99 = pct(loaded, 0.5) - pct(idle, 0.5), pct(loaded, 0.99) - pct(idle, 0.99)
    print(f"probe time to first chunk, {peak_open} calls open: p50 {pct(loaded, 0.5) * 1e3:.2f} ms, "
          f"p99 {pct(loaded, 0.99) * 1e3:.2f} ms (added by the load: p50 {added50 * 1e3:+.2f} ms, "
          f"p99 {added99 * 1e3:+.2f} ms)")
    print(f"errors: {sum(run.errors.values())}")
    for what, n in run.errors.most_common(5):
        print(f"  {n} x {what}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--ramp-s", type=float, default=30.0)
    ap.add_argument("--token-s", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=15)
    ap.add_argument("--limit-s", type=float, default=300.0, help="the whole run stops after this")
    args = ap.parse_args()
    fds = raise_fd_limit()
    if fds < 2 * args.calls + 512:
        sys.exit(f"open-file limit {fds} is too low for {args.calls} calls; raise it (ulimit -n)")

    server = PrivateRedis().start()
    gw_port = free_port()
    env = fleet_env(FLEET % {"slots": args.calls + 64, "token_s": args.token_s, "tokens": args.tokens}, server.url)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [fleetctl("gateway", "--port", str(gw_port), env=env),
             fleetctl("worker", "--tier", "slow", env=env, **quiet),
             fleetctl("worker", "--tier", "fast", env=env, **quiet)]
    r = redis.Redis.from_url(server.url)
    try:
        asyncio.run(asyncio.wait_for(
            main_async(args, f"http://127.0.0.1:{gw_port}/v1/chat/completions", procs[0].pid, r),
            args.limit_s + 120))
    finally:
        stop(procs)
        r.close()
        server.stop()


if __name__ == "__main__":
    main()
