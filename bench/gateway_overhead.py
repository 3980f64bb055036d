"""What the gateway adds, on both paths, in one run.

- baseline: the load straight to an instant OpenAI-compatible server (bench/mock_upstream.py);
- sim:      client -> gateway -> Redis line -> worker (`sim` engine, zero-latency profile);
- openai:   client -> gateway -> Redis line -> worker (`openai` engine) -> the same mock server:
            the real forwarding path, a fleet in front of vLLM / SGLang / TGI;
- messages: the same forwarding path called as Anthropic's `POST /v1/messages` (the same body,
            which is a valid Messages body too): the Messages mapping's cost, against `openai`.

Each at concurrency 1, 16 and 64, streaming and not: latency p50/p99 (non-streaming) or
time to first chunk (streaming), throughput, and the CPU each process spent per request
(from /proc, so Redis and the mock count too). All processes share this machine, so its
noise hits every path alike; the figures to read are the differences and ratios against
the baseline measured in the same run.

    .venv/bin/python bench/gateway_overhead.py [--requests 2000] [--tokens 16] [--paths sim,openai,messages]
        [--concurrency 1,16,64] [--profile DIR] [--gateways]

--profile DIR runs the gateway and the workers under cProfile and leaves their stats in DIR
(`python -m pstats DIR/gateway.prof`); the figures are then slower than without.

--gateways then also compares 1 and 2 gateway processes on one port
(`fleet gateway --workers N`) on the sim path, in front of the same worker and Redis.

--against REV runs a second fleet from a checkout of the git revision REV (a worktree under
/tmp) beside this one, on the same Redis and mock server, and measures the forwarding path
(`openai`) of both in alternating rounds (--rounds, the order swapped each round): C=1 added
p50 and C=64 req/s, streaming and not, with the ratio of this code to REV's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_config, cpu_s, fleet_env, fleetctl, pct, stop, zero_tier  # noqa: E402
from fleet.redis_server import PrivateRedis, free_port  # noqa: E402

FLEET = bench_config(zero_tier("routing"), """  forward:
    warm_floor: 1
    max_replicas: 1
    slots: 128
    engine: openai
    openai: {base_url: "http://127.0.0.1:%(mock)d/v1", model: mock}
""")
TIER = {"sim": "routing", "openai": "forward", "messages": "forward"}


async def _wait_http(url: str, model: str, limit_s: float = 60) -> None:
    end = time.monotonic() + limit_s
    async with httpx.AsyncClient() as c:
        while time.monotonic() < end:
            try:
                r = await c.post(url, json={"model": model, "messages": [{"role": "user", "content": "w"}],
                                            "max_tokens": 1}, timeout=2)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} ({model}) did not answer")


async def load(url: str, model: str, concurrency: int, total: int, tokens: int,
               stream: bool) -> tuple[list[float], float]:
    """`total` calls from `concurrency` users; per call the latency (non-streaming) or the time
    to the first chunk of the body (streaming, the whole stream is read); and the wall time."""
    # aiohttp, not httpx: at 64 concurrent callers httpx's own CPU cost would be
    # what is measured on 2 cores.
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "classify this"}],
                         "max_tokens": tokens, "stream": stream, "ignore_eos": True})  # exactly `tokens` each
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
                    if stream:
                        first = await r.content.readany()
                        lat.append(time.perf_counter() - t0)
                        data = first + await r.read()
                        # A chat stream ends with [DONE], a Messages stream with its message_stop event.
                        if r.status == 200 and not data.rstrip().endswith((b"[DONE]", b'"message_stop"}')):
                            raise RuntimeError(f"stream ended early: {data[-200:]!r}")
                    else:
                        data = await r.read()
                        lat.append(time.perf_counter() - t0)
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {data[:200]!r}")

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return lat, time.perf_counter() - t0


def redis_calls(r: redis.Redis) -> collections.Counter[str]:
    """Commands Redis has run so far, by name (scripts count as evalsha)."""
    return collections.Counter({k.removeprefix("cmdstat_"): int(v["calls"])
                                for k, v in r.info("commandstats").items()})


async def measure(urls: dict[str, str], pids: dict[str, int], paths: list[str], levels: list[int],
                  requests: int, tokens: int, r: redis.Redis) -> None:
    for path in ["baseline", *paths]:
        await _wait_http(urls[path], TIER.get(path, "mock"))
    names = list(pids)
    print("figures: p50/p99 ms of the whole call (non-streaming) or to the first chunk (streaming); "
          "CPU ms per request by process")
    print(f"{'path':<9}{'stream':>7}{'conc':>5}{'req':>6}{'p50':>8}{'p99':>8}{'req/s':>8}  "
          + " ".join(f"{n:>8}" for n in names) + "  Redis commands/req (calls inside scripts included)")
    rows: dict[tuple[str, bool, int], tuple[float, float, float]] = {}
    for stream in (False, True):
        for conc in levels:
            n = max(200, requests // (8 if conc == 1 else 1))
            for path in ["baseline", *paths]:
                model = TIER.get(path, "mock")
                await load(urls[path], model, conc, min(100, n), tokens, stream)  # warm-up
                before, cmds = {k: cpu_s(p) for k, p in pids.items()}, redis_calls(r)
                lat, wall = await load(urls[path], model, conc, n, tokens, stream)
                cpu = {k: (cpu_s(p) - before[k]) / n * 1e3 for k, p in pids.items()}
                cmds = redis_calls(r) - cmds
                rows[(path, stream, conc)] = (pct(lat, 0.5), pct(lat, 0.99), n / wall)
                p50, p99, rps = rows[(path, stream, conc)]
                print(f"{path:<9}{'yes' if stream else 'no':>7}{conc:>5}{n:>6}{p50 * 1e3:>8.2f}{p99 * 1e3:>8.2f}"
                      f"{rps:>8.0f}  " + " ".join(f"{cpu[k]:>8.2f}" for k in names)
                      + f"  {sum(cmds.values()) / n:.1f} ("
                      + ", ".join(f"{c} {v / n:.1f}" for c, v in cmds.most_common(4)) + ")", flush=True)
    print("\nadded by the fleet against the baseline of the same run (ms; throughput ratio):")
    for path in paths:
        for stream in (False, True):
            for conc in levels:
                b, g = rows[("baseline", stream, conc)], rows[(path, stream, conc)]
                what = "first chunk" if stream else "whole call"
                print(f"  {path:<7} {'streaming' if stream else 'non-stream'} C={conc:<3} {what}: "
                      f"p50 {(g[0] - b[0]) * 1e3:+.2f} p99 {(g[1] - b[1]) * 1e3:+.2f}; "
                      f"{g[2]:.0f} req/s vs {b[2]:.0f} direct (ratio {g[2] / b[2]:.2f})")


def compare_gateways(env: dict[str, str], requests: int, tokens: int, concurrency: int = 64) -> None:
    """Throughput through `fleet gateway --workers 1`, then `--workers 2`, each on a fresh
    port in front of the same worker; the ratio is the figure (on a box with fewer free
    cores than processes, it is capped by the cores, not the gateway)."""
    rows = {}
    for n in (1, 2):
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        p = fleetctl("gateway", "--port", str(port), "--workers", str(n), env=env)
        try:
            asyncio.run(_wait_http(url, TIER["sim"]))
            asyncio.run(load(url, TIER["sim"], concurrency, min(200, requests), tokens, False))  # warm-up
            lat, wall = asyncio.run(load(url, TIER["sim"], concurrency, requests, tokens, False))
            rows[n] = (pct(lat, 0.5), pct(lat, 0.99), requests / wall)
        finally:
            p.terminate()
            p.wait(45)
    print(f"\n{'gateways':<10}{'conc':>6}{'req':>7}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}")
    for n, (p50, p99, rps) in rows.items():
        print(f"{n:<10}{concurrency:>6}{requests:>7}{p50 * 1e3:>10.2f}{p99 * 1e3:>10.2f}{rps:>10.1f}")
    print(f"2 gateway processes vs 1: throughput ratio {rows[2][2] / rows[1][2]:.2f} "
          f"(cores on this box: {os.cpu_count()})")


def old_checkout(rev: str) -> Path:
    """A worktree of `rev` (made once, kept for reruns) whose code the second fleet runs."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = Path(f"/tmp/fleet-bench-{sha}")
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def start_old(rev: str, env: dict[str, str]) -> tuple[dict[str, subprocess.Popen[bytes]], str]:
    """The gateway and the forwarding worker of `rev`, in a namespace of their own; its URL."""
    root = old_checkout(rev)
    old_env = {**env, "PYTHONPATH": str(root), "FLEET_NAMESPACE": "bench-old"}
    port = free_port()
    procs = {f"gateway@{rev}": subprocess.Popen([sys.executable, "-m", "fleetctl", "gateway", "--port", str(port)],
                                                env=old_env, cwd=root),
             f"w-openai@{rev}": subprocess.Popen([sys.executable, "-m", "fleetctl", "worker", "--tier", "forward"],
                                                 env=old_env, cwd=root)}
    return procs, f"http://127.0.0.1:{port}/v1/chat/completions"


async def alternate(urls: dict[str, str], rev: str, rounds: int, requests: int, tokens: int) -> None:
    """The forwarding path of this code and of `rev`, alternately, `rounds` times each: C=1 added p50
    (against the baseline measured in the same round) and C=64 throughput."""
    for url, model in ((urls["baseline"], "mock"), (urls["new"], "forward"), (urls["old"], "forward")):
        await _wait_http(url, model)
    print(f"\nthis code against {rev}, the openai (forwarding) path, {rounds} alternating rounds:")
    for stream in (False, True):
        for conc in (1, 64):
            n = max(200, requests // (8 if conc == 1 else 1))
            got: dict[str, list[float]] = {"new": [], "old": []}
            for i in range(rounds):
                order = ("new", "old") if i % 2 == 0 else ("old", "new")
                base, _ = await load(urls["baseline"], "mock", conc, n, tokens, stream)
                for label in order:
                    await load(urls[label], "forward", conc, min(100, n), tokens, stream)  # warm-up
                    lat, wall = await load(urls[label], "forward", conc, n, tokens, stream)
                    got[label].append((pct(lat, 0.5) - pct(base, 0.5)) * 1e3 if conc == 1 else n / wall)
            what = "added p50 ms" if conc == 1 else "req/s"
            new, old = (sorted(v)[len(v) // 2] for v in (got["new"], got["old"]))
            ratio = new / old if old else float("nan")
            print(f"  {'streaming' if stream else 'non-stream'} C={conc:<3} {what}: this code {new:.2f} "
                  f"(rounds {', '.join(f'{x:.2f}' for x in got['new'])}), {rev} {old:.2f} "
                  f"(rounds {', '.join(f'{x:.2f}' for x in got['old'])}); ratio {ratio:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--gateways", action="store_true", help="also compare 1 and 2 gateway processes")
    ap.add_argument("--paths", default="sim,openai", help="which fleet paths: sim, openai, messages")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--profile", default=None, help="a folder: run gateway and workers under cProfile")
    ap.add_argument("--against", default=None, help="a git revision: compare its forwarding path with this code's")
    ap.add_argument("--rounds", type=int, default=3, help="with --against: alternating rounds")
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    levels = [int(c) for c in args.concurrency.split(",")]

    server = PrivateRedis().start()
    server_url = server.url
    gw_port, mock_port = free_port(), free_port()
    env = fleet_env(FLEET % {"mock": mock_port}, server_url)
    py = sys.executable

    def part(name: str, *argv: str) -> list[str]:
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            return [py, "-m", "cProfile", "-o", f"{args.profile}/{name}.prof", "-m", "fleetctl", *argv]
        return [py, "-m", "fleetctl", *argv]

    procs = {"mock": subprocess.Popen([py, str(ROOT / "bench" / "mock_upstream.py"), str(mock_port)],
                                      env=env, cwd=ROOT),
             "gateway": subprocess.Popen(part("gateway", "gateway", "--port", str(gw_port)), env=env, cwd=ROOT)}
    for path in paths:
        if path == "messages" and "openai" in paths:
            continue  # the openai path's worker serves both: one worker, so the two paths compare alike
        procs[f"w-{path}"] = subprocess.Popen(part(f"worker-{path}", "worker", "--tier", TIER[path]), env=env,
                                              cwd=ROOT)
    pids = {"client": os.getpid(), **{k: p.pid for k, p in procs.items()}, "redis": server.proc.pid}
    gw = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
    urls = {"baseline": f"http://127.0.0.1:{mock_port}/v1/chat/completions", **dict.fromkeys(paths, gw)}
    if "messages" in paths:
        urls["messages"] = f"http://127.0.0.1:{gw_port}/v1/messages"
    r = redis.Redis.from_url(server_url)
    try:
        if args.against:
            old, urls["old"] = start_old(args.against, env)
            procs.update(old)
            urls["new"] = gw
            asyncio.run(alternate(urls, args.against, args.rounds, args.requests, args.tokens))
            return
        asyncio.run(measure(urls, pids, paths, levels, args.requests, args.tokens, r))
        if args.gateways and "sim" in paths:
            compare_gateways(env, args.requests, args.tokens)
    finally:
        stop(procs.values(), signal.SIGINT)  # SIGINT: cProfile writes its stats on a clean exit
        r.close()
        server.stop()


if __name__ == "__main__":
    main()
