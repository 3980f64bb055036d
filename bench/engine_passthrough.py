"""What the fleet costs a real engine: vLLM driven directly, against the same vLLM behind
gateway -> Redis line -> `fleet worker --engine vllm`: same model, engine settings,
concurrency and requests, in the same run.

Two engines are started, one after the other (starting them at once starves both on
2 cores): `VllmEngine` in this process, and the fleet's worker as a subprocess next to
the gateway and a private Redis. An idle vLLM engine costs no CPU, so the two paths then
take turns, round after round, and the machine's drift (other work on a shared box)
hits both alike. Every request is a streaming chat call asking for exactly `--tokens`
tokens (`ignore_eos`) from the tiny test model (tests/tinymodel.py, built here, no download).

    .venv/bin/python bench/engine_passthrough.py [--concurrency 8] [--requests 96] [--tokens 128] [--rounds 3]

Throughput is completion tokens / wall time of a round; TTFT is what the caller sees (the
first delta from the engine; the first content chunk through the gateway). The goal is a
gateway throughput of at least 95% of the engine's own. CPU seconds by process show where
the difference goes: on a CPU-only box the fleet's processes share the cores the engine
computes on, which a GPU box (the forward pass on the GPU, spare host cores) does not.

So CPU microseconds per streamed token are reported by process too. All but the engine
core's stay on a GPU box's host: a CPU box's run gives the host's cost per token on either
path, and the fleet's own share (through the fleet less vLLM alone) against vLLM's front end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.config import VllmSettings  # noqa: E402
from fleet.redis_server import PrivateRedis, free_port  # noqa: E402
from fleet.store.keys import TierKeys  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Summarise the state of the order book in one line."}]
KV_BYTES = 256 * 1024 * 1024
ENGINE_CORE = "engine core"  # vLLM's engine core and its workers: the part a GPU box runs on the GPU
MAX_MODEL_LEN = 2048

FLEET_YAML = """
namespace: bench
default_deadline_ms: 600000
heartbeat_s: 1.0
tiers:
  routing:
    engine: vllm
    warm_floor: 1
    max_replicas: 1
    slots: {conc}
    lease_s: 30
    wait_limit_s: {{committed: 600, interactive: 600, speculative: 600, background: 600}}
    # Optimistic on purpose: admission must not shed the benchmark's burst.
    sim: {{typical_prompt_tokens: 32, typical_output_tokens: {tokens}, decode_step: {{base_s: 0.0001, per_seq_s: 0}}}}
    vllm:
      model: "{model}"
      max_num_seqs: {conc}
      max_model_len: {max_len}
      kv_cache_memory_bytes: {kv}
      dtype: bfloat16
      enforce_eager: true
      warmup_tokens: 4
"""


def cpu_s(procs: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far by each named group of processes."""
    import psutil

    out: dict[str, float] = {}
    for name, pids in procs.items():
        total = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
        out[name] = total
    return out


def family(pid: int) -> tuple[list[int], list[int]]:
    """A process, and its descendants (vLLM's engine core and its worker run as children)."""
    import psutil

    return [pid], [p.pid for p in psutil.Process(pid).children(recursive=True)]


@dataclass
class Run:
    name: str
    tokens: int
    wall_s: float
    ttft_s: list[float]
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by process during the run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def ttft(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


One = Callable[[str], Awaitable[tuple[float, int]]]  # request id -> (ttft_s, completion tokens)


async def drive(name: str, one: One, concurrency: int, requests: int,
                procs: dict[str, list[int]] | None = None) -> Run:
    """`requests` calls of `one`, `concurrency` at a time."""
    left = list(range(requests))
    ttfts: list[float] = []
    tokens = 0
    tag = f"{name}-{time.monotonic_ns()}"

    async def caller() -> None:
        nonlocal tokens
        while left:
            i = left.pop()
            ttft, n = await one(f"{tag}-{i}")
            ttfts.append(ttft)
            tokens += n

    procs = procs or {}
    cpu0 = cpu_s(procs)
    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    cpu1 = cpu_s(procs)
    return Run(name, tokens, wall, ttfts, {k: cpu1[k] - cpu0[k] for k in procs})


def engine_caller(engine, tokens: int) -> One:  # type: ignore[no-untyped-def]
    from workers.engines.base import EngineRequest

    async def one(rid: str) -> tuple[float, int]:
        req = EngineRequest.build(request_id=rid, kind="chat", messages=MESSAGES, max_tokens=tokens, temperature=1.0,
                            ignore_eos=True)
        t0 = time.perf_counter()
        ttft, n = 0.0, 0
        async for d in engine.generate(req):
            if not ttft and d.text:
                ttft = time.perf_counter() - t0
            n = d.completion_tokens
        return ttft, n

    return one


def gateway_caller(session: aiohttp.ClientSession, url: str, tokens: int) -> One:
    body = orjson.dumps({"model": "routing", "messages": MESSAGES, "max_tokens": tokens, "stream": True,
                         "stream_options": {"include_usage": True}, "ignore_eos": True})
    headers = {"content-type": "application/json"}

    async def one(_: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        ttft, n = 0.0, 0
        async with session.post(url, data=body, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"gateway answered {r.status}: {(await r.read())[:300]!r}")
            async for raw in r.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ev = orjson.loads(line[6:])
                if not ttft and ev["choices"] and ev["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
                if ev.get("usage"):
                    n = ev["usage"]["completion_tokens"]
        return ttft, n

    return one


def start_fleet(model: Path, work: Path, args: argparse.Namespace) -> tuple[PrivateRedis, list[subprocess.Popen[bytes]],
                                                                         int]:
    """A private Redis, the gateway and one `--engine vllm` worker; (redis, [gateway, worker], port)."""
    server = PrivateRedis().start()
    cfg = work / "fleet.yaml"
    cfg.write_text(FLEET_YAML.format(conc=args.concurrency, tokens=args.tokens, model=model, max_len=MAX_MODEL_LEN,
                                     kv=KV_BYTES))
    env = {**os.environ, "REDIS_URL": server.url, "FLEET_CONFIG": str(cfg), "FLEET_NAMESPACE": "bench"}
    port = free_port()
    py = sys.executable
    procs = [subprocess.Popen([py, "-m", "fleetctl", "gateway", "--port", str(port)], env=env, cwd=ROOT),
             subprocess.Popen([py, "-m", "fleetctl", "worker", "--tier", "routing", "--engine", "vllm",
                               "--replica-id", "routing-bench"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    return server, procs, port


def stop_fleet(server: PrivateRedis, procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
    server.stop()


async def wait_ready(redis_url: str, procs: list[subprocess.Popen[bytes]], limit_s: float = 300) -> float:
    r = aioredis.Redis.from_url(redis_url)
    try:
        end = time.monotonic() + limit_s
        while True:
            raw = await r.hget(TierKeys("bench", "routing").replicas, "routing-bench")
            if raw and (beat := orjson.loads(raw))["state"] == "ready":
                return float(beat["cold_start_s"])
            if any(p.poll() is not None for p in procs) or time.monotonic() > end:
                raise RuntimeError("the gateway or the worker did not come up")
            await asyncio.sleep(0.25)
    finally:
        await r.aclose()


async def bench(model: Path, work: Path, args: argparse.Namespace) -> list[tuple[Run, Run]]:
    from workers.engines.vllm_engine import VllmEngine

    engine = VllmEngine(VllmSettings(model=str(model), max_num_seqs=args.concurrency, max_model_len=MAX_MODEL_LEN,
                                     kv_cache_memory_bytes=KV_BYTES, dtype="bfloat16", enforce_eager=True))
    await engine.start()
    print(f"engine ready (cold start {engine.cold_start_s:.1f} s)", flush=True)
    own, engine_core = family(os.getpid())

    server, procs, port = start_fleet(model, work, args)
    try:
        print(f"worker ready (cold start {await wait_ready(server.url, procs):.1f} s)", flush=True)
        worker, worker_engine = family(procs[1].pid)
        direct_procs = {"bench (client, vLLM front end)": own, ENGINE_CORE: engine_core}
        fleet_procs = {"client": own, "gateway": [procs[0].pid], "redis": [server.proc.pid],
                       "worker (vLLM front end)": worker, ENGINE_CORE: worker_engine}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            direct = engine_caller(engine, args.tokens)
            gateway = gateway_caller(session, f"http://127.0.0.1:{port}/v1/chat/completions", args.tokens)
            for one in (direct, gateway):  # warm-up, not measured
                await drive("warm-up", one, args.concurrency, args.concurrency * 2)
            rounds = []
            for i in range(args.rounds):
                # Alternate which goes first, so neither always meets the same moment of the box.
                order = [("engine", direct, direct_procs), ("gateway", gateway, fleet_procs)]
                runs = {name: await drive(name, one, args.concurrency, args.requests, procs_)
                        for name, one, procs_ in (order if i % 2 == 0 else order[::-1])}
                rounds.append((runs["engine"], runs["gateway"]))
                e, g = rounds[-1]
                print(f"round {i + 1}: engine {e.tokens_per_s:.0f} tokens/s, gateway {g.tokens_per_s:.0f} tokens/s "
                      f"({g.tokens_per_s / e.tokens_per_s:.1%})", flush=True)
        return rounds
    finally:
        stop_fleet(server, procs)
        await engine.stop()


def report(rounds: list[tuple[Run, Run]]) -> None:
    print(f"\n{'path':<10}{'round':>6}{'requests':>9}{'tokens':>8}{'wall s':>8}{'tokens/s':>10}{'TTFT p50 ms':>13}"
          f"{'TTFT p90 ms':>13}")
    for i, pair in enumerate(rounds):
        for r in pair:
            print(f"{r.name:<10}{i + 1:>6}{len(r.ttft_s):>9}{r.tokens:>8}{r.wall_s:>8.2f}{r.tokens_per_s:>10.0f}"
                  f"{r.ttft(0.5) * 1e3:>13.1f}{r.ttft(0.9) * 1e3:>13.1f}")
    print()
    per_token = {}
    for name, k in (("engine", 0), ("gateway", 1)):
        runs = [pair[k] for pair in rounds]
        keys = runs[0].cpu_s
        cpu = {key: statistics.fmean(r.cpu_s[key] for r in runs) for key in keys}
        per_token[name] = {key: sum(r.cpu_s[key] for r in runs) / sum(r.tokens for r in runs) * 1e6 for key in keys}
        print(f"{name} CPU seconds a round: " + ", ".join(f"{key} {v:.2f}" for key, v in cpu.items())
              + f" (total {sum(cpu.values()):.2f})")
    host_share(per_token)
    ratios = [g.tokens_per_s / e.tokens_per_s for e, g in rounds]
    e_tps = statistics.median(e.tokens_per_s for e, _ in rounds)
    g_tps = statistics.median(g.tokens_per_s for _, g in rounds)
    ttft_e = statistics.median(e.ttft(0.5) for e, _ in rounds)
    ttft_g = statistics.median(g.ttft(0.5) for _, g in rounds)
    print(f"\nmedian of {len(rounds)} rounds: engine {e_tps:.0f} tokens/s, TTFT p50 {ttft_e * 1e3:.1f} ms; "
          f"gateway {g_tps:.0f} tokens/s, TTFT p50 {ttft_g * 1e3:.1f} ms")
    print(f"through the gateway: {statistics.median(ratios):.1%} of the engine's own throughput "
          f"(rounds: {', '.join(f'{x:.1%}' for x in ratios)}; goal >= 95%); "
          f"TTFT p50 {(ttft_g - ttft_e) * 1e3:+.1f} ms")


def host_share(per_token: dict[str, dict[str, float]]) -> None:
    """CPU microseconds per streamed token by process, and what stays on a GPU box's host.

    On a GPU box the engine core's forward pass runs on the GPU; what every other process
    spends per token stays on the host's cores. So a CPU box's run gives the host's cost per
    token, and the cores a token rate needs, for each path."""
    print("\nCPU us per streamed token, by process:")
    for name, costs in per_token.items():
        print(f"  {name:<8} " + ", ".join(f"{key} {v:.0f}" for key, v in costs.items()))
    outside = {name: sum(v for key, v in costs.items() if key != ENGINE_CORE) for name, costs in per_token.items()}
    alone, fleet = outside["engine"], outside["gateway"]
    print(f"outside the engine core: vLLM alone {alone:.0f} us a token (its front end), through the fleet "
          f"{fleet:.0f} us; the fleet's own share {fleet - alone:.0f} us, {(fleet - alone) / alone:.1f}x vLLM's "
          f"front end (goal <= 2x)")
    print(f"  on a GPU box streaming 10,000 tokens/s, the host's cores needed: vLLM alone {alone * 0.01:.2f}, "
          f"through the fleet {fleet * 0.01:.2f} (client and Redis included)")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96, help="requests per path per round")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    from tests.tinymodel import vllm_environment

    env_scope = contextlib.ExitStack()  # vLLM's private dirs and offline settings, for the whole run
    env_scope.enter_context(vllm_environment(work))

    from tests.tinymodel import build_tiny_model

    model = build_tiny_model(work / "tiny-model")
    print(f"tiny model in {model}; per path and round: {args.requests} streaming chat requests x {args.tokens} "
          f"tokens, {args.concurrency} at a time", flush=True)
    report(asyncio.run(bench(model, work, args)))


if __name__ == "__main__":
    main()
