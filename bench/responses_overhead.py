"""What the Responses API costs against chat completions, through the same fleet, in one run.

One gateway, one Redis, one `sim` replica that costs nothing (bench/common.py `zero_tier`), so
what differs is the gateway's own work: mapping the Responses body to the chat call, writing the
answer as a Response (or the Responses events), and, with `store: true`, one SET of the stored
response (and one GET of the previous one for a continued turn). Three kinds of call:

- chat:       POST /v1/chat/completions, one user turn;
- responses:  POST /v1/responses, the same turn as `input` (store: true, OpenAI's default);
- continued:  POST /v1/responses with `previous_response_id` of a stored two-turn conversation.

Each at concurrency 1 and 16, streamed and not, in alternating rounds (the order rotated each
round, so drift on a shared machine hits all alike): p50 latency (non-streaming) or time to the
first bytes (streaming), throughput, the gateway's CPU per call, and each kind's ratio to chat.

    .venv/bin/python bench/responses_overhead.py [--requests 400] [--tokens 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_config, cpu_s, fleet_env, fleetctl, pct, stop, zero_tier  # noqa: E402
from fleet.redis_server import PrivateRedis, free_port  # noqa: E402

TIER = "routing"
KINDS = ("chat", "responses", "continued")


def bodies(tokens: int, stream: bool, previous: str) -> dict[str, tuple[str, bytes]]:
    """Each kind's path and body; each answered with exactly `tokens` (vLLM's `ignore_eos`), so the kinds
    differ only in the gateway's work."""
    turn = "classify this"
    return {
        "chat": ("/v1/chat/completions", orjson.dumps({"model": TIER, "messages": [{"role": "user", "content": turn}],
                                                        "max_tokens": tokens, "stream": stream, "ignore_eos": True})),
        "responses": ("/v1/responses", orjson.dumps({"model": TIER, "input": turn, "max_output_tokens": tokens,
                                                     "stream": stream, "ignore_eos": True})),
        "continued": ("/v1/responses", orjson.dumps({"model": TIER, "input": turn, "max_output_tokens": tokens,
                                                     "stream": stream, "previous_response_id": previous,
                                                     "ignore_eos": True})),
    }


async def load(url: str, body: bytes, concurrency: int, total: int, stream: bool) -> tuple[list[float], float]:
    """`total` calls from `concurrency` users: per call the latency (or time to first bytes), and the wall time."""
    lat: list[float] = []
    left = total
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as c:
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
                    else:
                        data = await r.read()
                        lat.append(time.perf_counter() - t0)
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {data[:300]!r}")

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return lat, time.perf_counter() - t0


def ready(base: str, limit_s: float = 60) -> str:
    """Wait for the fleet to serve; then store a two-turn conversation and return its last id."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            r = httpx.post(f"{base}/v1/responses", json={"model": TIER, "input": "w", "max_output_tokens": 4},
                           timeout=5)
            if r.status_code == 200:
                second = httpx.post(f"{base}/v1/responses", timeout=5, json={
                    "model": TIER, "input": "and then?", "max_output_tokens": 4,
                    "previous_response_id": r.json()["id"]})
                second.raise_for_status()
                return str(second.json()["id"])
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the fleet did not answer")


async def measure(base: str, gw_pid: int, args: argparse.Namespace, previous: str) -> None:
    print(f"{'stream':>6} {'C':>3} {'kind':>10} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'gw CPU ms':>9}"
          f" {'p50/chat':>9} {'req/s/chat':>10} {'CPU/chat':>9}")
    for stream in (False, True):
        calls = bodies(args.tokens, stream, previous)
        for conc in (1, 16):
            got: dict[str, tuple[list[float], float, float]] = {k: ([], 0.0, 0.0) for k in KINDS}
            for rnd in range(args.rounds):
                order = KINDS[rnd % 3:] + KINDS[:rnd % 3]
                for kind in order:
                    path, body = calls[kind]
                    await load(base + path, body, conc, min(50, args.requests), stream)  # warm-up
                    c0 = cpu_s(gw_pid)
                    lat, wall = await load(base + path, body, conc, args.requests, stream)
                    cpu = cpu_s(gw_pid) - c0
                    prev = got[kind]
                    got[kind] = (prev[0] + lat, prev[1] + wall, prev[2] + cpu)
            n = args.requests * args.rounds
            base_p50 = pct(got["chat"][0], 0.5)
            base_rate = n / got["chat"][1]
            base_cpu = got["chat"][2] / n
            for kind in KINDS:
                lat, wall, cpu = got[kind]
                p50, rate, per = pct(lat, 0.5), n / wall, cpu / n
                print(f"{stream!s:>6} {conc:>3} {kind:>10} {p50 * 1e3:8.2f} {pct(lat, 0.99) * 1e3:8.2f} "
                      f"{rate:8.0f} {per * 1e3:9.3f} {p50 / base_p50:9.2f} {rate / base_rate:10.2f} "
                      f"{per / base_cpu:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400, help="calls per kind, level and round")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    server = PrivateRedis().start()
    port = free_port()
    env = fleet_env(bench_config(zero_tier(TIER)), server.url)
    procs = [fleetctl("gateway", "--port", str(port), env=env), fleetctl("worker", "--tier", TIER, env=env)]
    base = f"http://127.0.0.1:{port}"
    try:
        previous = ready(base)
        print(f"responses vs chat completions, one fleet ({os.cpu_count()} CPUs), {args.requests} calls x "
              f"{args.rounds} rounds per row, {args.tokens} tokens")
        asyncio.run(measure(base, procs[0].pid, args, previous))
    finally:
        stop(procs)
        server.stop()


if __name__ == "__main__":
    main()
