"""The token relay alone, at scale: sim worker -> Redis result stream -> one gateway process -> SSE.

A `sim` tier (`relay`) whose replicas cost nothing but their decode step: every open call
gets a token each `--step-ms` (0: as fast as the worker's loop turns), so the engine asks
for N x 1000 / step-ms tokens a second and the relay is what limits delivery. N streaming
chat calls stay open (each caller starts its next call when one ends) through one gateway
process, one Redis and `--sim-workers` workers, for `--duration-s` at each N of `--calls`
(10 to 2,000), after a warm-up: `--warmup-s`, and then until every caller's first call has
ended (N calls opened at once, which is not the steady state measured; at most 60 s more).

Per N: streamed tokens/s delivered to callers, tokens per chunk and chunks per call, CPU
(ms) per 1,000 tokens of the gateway, the workers, Redis and this client (from /proc), TTFT
(time to the first token's bytes) p50/p99, and errors (a status other than 200, a broken
stream, one not ending in [DONE], or a usage count that differs from the tokens read).

The baseline, in the same run and at the same N: the same client reading a trivial SSE
server (bench/sse_baseline.py: Starlette on uvicorn, as the gateway) that writes the same
chunks (the fleet's measured tokens per chunk, the first token alone, at the same step).
Ratios: fleet tokens/s against the baseline's, and the fleet's CPU per token (gateway +
workers + Redis) against the baseline server's.

From the measured costs at the N nearest 1,000: how many gateway processes
(`fleet gateway --workers`) and Redis instances a token rate (`--plan`) needs, each kept at
`--busy` of one core. Traffic goes to 127.0.0.1 only; each level ends at its duration, and
the whole run at `--limit-s`.

    .venv/bin/python bench/token_relay.py [--calls 10,100,200,500,1000,2000] [--duration-s 15]
        [--warmup-s 3] [--tokens 128] [--step-ms 1] [--sim-workers 1] [--profile DIR]

--profile DIR also samples the gateway and the (first) worker with py-spy (`--format raw`) during each
level's measured window and prints each one's top costs (share of its samples, by function).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import redis.asyncio as aioredis
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import pyspy  # noqa: E402
from bench.common import cpu_s, fleet_env, fleetctl, paced_fleet, pct, raise_fd_limit, stop  # noqa: E402
from fleet.redis_server import PrivateRedis, free_port  # noqa: E402

MESSAGES = [{"role": "user", "content": "relay"}]
CHUNK_MARK = b'"delta":{"content"'  # a chunk that carries tokens (the role chunk's delta starts with "role")
DATA = b"data: "  # an SSE event's mark, with a space of its own
USAGE = re.compile(rb'"completion_tokens":(\d+)')
SETTLE_LIMIT_S = 60.0  # the longest a level's warm-up waits, past --warmup-s, for every caller's first call


@dataclass
class Level:
    """One path at one N: what the callers read in the measured window."""

    path: str
    n: int
    warmup_s: float = 0.0  # from the first call to the window: `--warmup-s`, or until every first call ended
    window_s: float = 0.0
    tokens: int = 0  # tokens read in the window
    chunks: int = 0  # token-carrying SSE chunks read in the window
    calls: int = 0  # calls ended in the window
    ttft: list[float] = field(default_factory=list)  # of the calls started in the window
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds in the window, by process group
    commands: collections.Counter[str] = field(default_factory=collections.Counter)  # Redis's, in the window
    command_us: collections.Counter[str] = field(default_factory=collections.Counter)  # ... the time they took

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s else 0.0

    @property
    def tokens_per_chunk(self) -> float:
        return self.tokens / self.chunks if self.chunks else 0.0

    def cpu_per_k(self, group: str) -> float:
        """CPU ms this group spent per 1,000 tokens delivered."""
        return self.cpu[group] / self.tokens * 1e6 if self.tokens else math.nan


class Window:
    """The measured stretch of a level, opened by its meter: `inside(t)` tells whether a moment falls in it."""

    def __init__(self) -> None:
        self.start = self.end = math.inf

    def open(self, duration_s: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + duration_s

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end


async def call(s: aiohttp.ClientSession, url: str, body: bytes, lv: Level, w: Window) -> None:
    """One streaming call, read as it arrives. The sim's tokens are words, each after a space
    but the first, and neither the gateway nor the baseline writes a space in its JSON: a
    piece's tokens are its spaces less those of its `data: ` marks, checked against the usage
    chunk at the end."""
    t0 = time.monotonic()
    spaces = chunks = 0
    first_at = 0.0
    carry = tail = b""
    try:
        async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
            if r.status != 200:
                lv.errors[f"HTTP {r.status}: {(await r.read())[:100]!r}"] += 1
                return
            async for piece in r.content.iter_any():
                now = time.monotonic()
                if not first_at:
                    first_at = now
                    if w.inside(t0):
                        lv.ttft.append(now - t0)
                # A mark split between pieces is counted once, in its last: each is looked for in this
                # piece and the bytes before it, one fewer than the mark's.
                n_ch = (carry + piece).count(CHUNK_MARK)
                n_sp = piece.count(b" ") - (carry[-len(DATA) + 1:] + piece).count(DATA)
                carry, tail = (carry + piece)[-len(CHUNK_MARK) + 1:], (tail + piece)[-1024:]
                spaces += n_sp
                chunks += n_ch
                if w.inside(now):
                    lv.tokens += n_sp + (1 if first_at == now else 0)
                    lv.chunks += n_ch
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        lv.errors[f"{type(e).__name__}: {str(e)[:80]}"] += 1
        return
    usage = USAGE.findall(tail)
    if not tail.endswith(b"data: [DONE]\n\n") or b'"error"' in tail:
        lv.errors[f"stream ended without [DONE]: {tail[-100:]!r}"] += 1
    elif not usage or int(usage[-1]) != spaces + 1:
        lv.errors[f"usage says {usage[-1:]} tokens, {spaces + 1} read"] += 1
    elif w.inside(time.monotonic()):
        lv.calls += 1


async def run_level(path: str, url: str, n: int, body: dict[str, object], pids: dict[str, list[int]],
                    args: argparse.Namespace, redis: aioredis.Redis | None = None) -> Level:
    """N callers, each calling again as its call ends, until the window closes; CPU (and the
    commands `redis` ran) read at its two ends."""
    lv = Level(path, n)
    w = Window()
    # The first call of each caller asks for a share of the tokens, so the callers' calls end apart.
    first = [orjson.dumps({**body, "max_tokens": 1 + i * args.tokens // n}) for i in range(n)]
    rest = orjson.dumps(body)
    firsts_left = [n]
    settled = asyncio.Event()  # every caller's first call has ended: N calls opened at once are behind us

    async def caller(i: int) -> None:
        for k in range(args.max_calls):  # bounded in count as well as in time
            if time.monotonic() >= w.end:
                return
            await call(s, url, first[i] if k == 0 else rest, lv, w)
            if k == 0:
                firsts_left[0] -= 1
                if not firsts_left[0]:
                    settled.set()

    async def meter() -> None:
        t0 = time.monotonic()
        await asyncio.sleep(args.warmup_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(settled.wait(), SETTLE_LIMIT_S)
        lv.warmup_s = time.monotonic() - t0
        before = {g: sum(cpu_s(p) for p in ps) for g, ps in pids.items()}
        commands, command_us = await redis_commands(redis)
        w.open(args.duration_s)
        profiling = [pyspy.record(ps[0], Path(args.profile) / f"{path}-{n}-{g}.txt", args.duration_s)
                     for g, ps in pids.items() if args.profile and g in ("gateway", "workers")]
        await asyncio.sleep(max(0.0, w.end - time.monotonic()))
        lv.window_s = time.monotonic() - w.start
        lv.cpu = {g: sum(cpu_s(p) for p in ps) - before[g] for g, ps in pids.items()}
        commands_now, command_us_now = await redis_commands(redis)
        lv.commands, lv.command_us = commands_now - commands, command_us_now - command_us
        for p in profiling:
            p.wait(30)

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.warmup_s + SETTLE_LIMIT_S + args.duration_s + 60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        await asyncio.gather(meter(), *(caller(i) for i in range(n)))
    return lv


async def redis_commands(r: aioredis.Redis | None) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Commands Redis has run so far, and the microseconds they took, by name (a script's own
    calls are counted apart too, and their time is in the script's)."""
    stats = await r.info("commandstats") if r is not None else {}
    names = [(k.removeprefix("cmdstat_"), v) for k, v in stats.items()]
    return (collections.Counter({k: int(v["calls"]) for k, v in names}),
            collections.Counter({k: int(v["usec"]) for k, v in names}))


# --- the run --------------------------------------------------------------------------------------

async def wait_answers(url: str, body: dict[str, object], procs: list[subprocess.Popen[bytes]],
                       limit_s: float = 90) -> None:
    """Until a one-token call through `url` completes (the parts are up)."""
    end = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a part of the fleet exited while starting")
            try:
                async with s.post(url, data=orjson.dumps({**body, "max_tokens": 1})) as r:
                    if r.status == 200 and (await r.read()).rstrip().endswith(b"[DONE]"):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {limit_s:.0f} s")


async def sweep(args: argparse.Namespace, fleet_url: str, base_url: str, pids: dict[str, dict[str, list[int]]],
                procs: list[subprocess.Popen[bytes]], redis_url: str) -> list[tuple[Level, Level]]:
    """At each N: the fleet, then the baseline with the fleet's tokens per chunk."""
    body: dict[str, object] = {"model": "relay", "messages": MESSAGES, "max_tokens": args.tokens, "stream": True,
                               "stream_options": {"include_usage": True}, "ignore_eos": True}  # exact lengths
    step = {"step_s": args.step_ms / 1000}  # the baseline's pace, and its chunks' size below
    await wait_answers(fleet_url, body, procs)
    await wait_answers(base_url, {**body, **step, "chunk_tokens": 1}, procs)
    end = time.monotonic() + args.limit_s
    rows = []
    redis = aioredis.Redis.from_url(redis_url)
    try:
        for n in args.calls:
            if time.monotonic() + 2 * (args.warmup_s + args.duration_s) + SETTLE_LIMIT_S > end:
                print(f"stopped before N={n}: the run's limit ({args.limit_s:.0f} s) is near", flush=True)
                break
            fleet = await run_level("fleet", fleet_url, n, body, pids["fleet"], args, redis)
            chunks = {"chunk_tokens": max(1, round(fleet.tokens_per_chunk))}
            base = await run_level("baseline", base_url, n, {**body, **step, **chunks}, pids["baseline"], args)
            rows.append((fleet, base))
            print(f"N={n}: fleet {fleet.tokens_per_s:,.0f} tokens/s, baseline {base.tokens_per_s:,.0f} "
                  f"({fleet.tokens_per_s / max(1.0, base.tokens_per_s):.1%}); errors {sum(fleet.errors.values())}",
                  flush=True)
    finally:
        await redis.aclose()
    return rows


GROUPS = ("gateway", "workers", "redis", "server", "client")


def report(rows: list[tuple[Level, Level]], args: argparse.Namespace) -> None:
    """The table by N and path, the ratios against the baseline, Redis's commands, and the sizing."""
    asked = "as fast as the loop turns" if args.step_ms == 0 else f"{1000 / args.step_ms:,.0f} tokens/s a call"
    print(f"\n{args.tokens} tokens a call, asked {asked}; CPU ms per 1,000 tokens delivered, by process")
    print(f"{'N':>5}{'path':>9}{'warm s':>7}{'calls':>7}{'tokens/s':>10}{'tok/chunk':>10}{'chunks/call':>12}"
          f"{'TTFT p50':>9}{'p99 ms':>8}" + "".join(f"{g:>8}" for g in GROUPS) + f"{'errors':>7}")
    for pair in rows:
        for lv in pair:
            print(f"{lv.n:>5}{lv.path:>9}{lv.warmup_s:>7.1f}{lv.calls:>7}{lv.tokens_per_s:>10,.0f}{lv.tokens_per_chunk:>10.1f}"
                  f"{args.tokens / max(lv.tokens_per_chunk, 1e-9):>12.1f}{pct(lv.ttft, 0.5) * 1e3:>9.1f}"
                  f"{pct(lv.ttft, 0.99) * 1e3:>8.1f}"
                  + "".join(f"{lv.cpu_per_k(g) if g in lv.cpu else math.nan:>8.1f}" for g in GROUPS)
                  + f"{sum(lv.errors.values()):>7}")
    print("\nagainst the baseline of the same run (same client, same chunks, same N); Redis's commands (a script's "
          "own calls counted apart):")
    for fleet, base in rows:
        relay = sum(fleet.cpu_per_k(g) for g in ("gateway", "workers", "redis"))
        per_k = {c: k / max(1, fleet.tokens) * 1000 for c, k in fleet.commands.most_common(8)}
        print(f"  N={fleet.n:<5} tokens/s {fleet.tokens_per_s / max(1.0, base.tokens_per_s):6.1%} of the baseline's; "
              f"relay CPU per token {relay / base.cpu_per_k('server'):4.1f}x the baseline server's")
        print(f"    Redis commands per 1,000 tokens {sum(fleet.commands.values()) / max(1, fleet.tokens) * 1000:.0f}: "
              + ", ".join(f"{c} {v:.1f}" for c, v in per_k.items()))
        print("    Redis's time (us) per 1,000 tokens, by command (a script's holds its own calls'): " + ", ".join(
            f"{c} {v / max(1, fleet.tokens) * 1000:.0f}" for c, v in fleet.command_us.most_common(6)))
        for what, k in (fleet.errors + base.errors).most_common(3):
            print(f"    {k} x {what}")
    if rows:
        plan(min(rows, key=lambda p: abs(p[0].n - 1000))[0], args)


def plan(lv: Level, args: argparse.Namespace) -> None:
    """Gateway processes and Redis instances for each rate in `--plan`, from `lv`'s CPU per token."""
    gw, rd = lv.cpu_per_k("gateway") / 1e6, lv.cpu_per_k("redis") / 1e6  # CPU seconds per token
    print(f"\nsized from N={lv.n}: a gateway process spends {gw * 1e6:.1f} us CPU a token, Redis {rd * 1e6:.1f} us; "
          f"each kept at {args.busy:.0%} of one core (one gateway process: {args.busy / gw:,.0f} tokens/s, "
          f"one Redis: {args.busy / rd:,.0f} tokens/s)")
    for rate in args.plan:
        print(f"  {rate:>9,} tokens/s: `fleet gateway --workers {math.ceil(rate * gw / args.busy)}`, "
              f"{math.ceil(rate * rd / args.busy)} Redis instance(s) (primaries of a cluster)")
    print("  (a tier's keys share one hash slot: all of one tier's tokens go through one Redis primary, so "
          f"one tier streams at most about {args.busy / rd:,.0f} tokens/s; more primaries carry more tiers)")


def profiles(args: argparse.Namespace, rows: list[tuple[Level, Level]]) -> None:
    for fleet, _ in rows:
        for group in ("gateway", "workers"):
            if (raw := Path(args.profile) / f"fleet-{fleet.n}-{group}.txt").exists():
                pyspy.print_top(raw, f"{group} at N={fleet.n}")


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--calls", type=ints, default=ints("10,100,200,500,1000,2000"), help="the Ns to sweep")
    ap.add_argument("--duration-s", type=float, default=15.0, help="measured window per N and path")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="before each window, at least")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens a call")
    ap.add_argument("--step-ms", type=float, default=1.0, help="the sim's decode step (0: as fast as it can)")
    ap.add_argument("--sim-workers", type=int, default=1)
    ap.add_argument("--max-calls", type=int, default=100_000, help="calls per caller per level, at most")
    ap.add_argument("--plan", type=ints, default=ints("20000,100000,500000"), help="token rates to size for")
    ap.add_argument("--busy", type=float, default=0.7, help="the share of a core each process is sized to")
    ap.add_argument("--limit-s", type=float, default=900.0, help="the whole run stops after this")
    ap.add_argument("--profile", default="", help="a folder for py-spy samples of the gateway and the workers")
    args = ap.parse_args()
    if raise_fd_limit() < 2 * max(args.calls) + 512:
        sys.exit(f"the open-file limit is too low for {max(args.calls)} calls; raise it (ulimit -n)")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)

    server = PrivateRedis().start()
    gw_port, base_port = free_port(), free_port()
    config = paced_fleet("relay", slots=max(args.calls) // args.sim_workers + 64, step_s=args.step_ms / 1000,
                         tokens=args.tokens, replicas=args.sim_workers)
    env = fleet_env(config, server.url)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    gateway = fleetctl("gateway", "--port", str(gw_port), env=env)
    workers = [fleetctl("worker", "--tier", "relay", env=env, **quiet) for _ in range(args.sim_workers)]
    baseline = subprocess.Popen([sys.executable, str(ROOT / "bench" / "sse_baseline.py"), str(base_port)], cwd=ROOT)
    procs = [gateway, *workers, baseline]
    me = [os.getpid()]
    pids = {"fleet": {"gateway": [gateway.pid], "workers": [w.pid for w in workers],
                      "redis": [server.proc.pid], "client": me},  # type: ignore[union-attr]
            "baseline": {"server": [baseline.pid], "client": me}}
    try:
        rows = uvloop.run(asyncio.wait_for(
            sweep(args, f"http://127.0.0.1:{gw_port}/v1/chat/completions",
                  f"http://127.0.0.1:{base_port}/v1/chat/completions", pids, procs, server.url), args.limit_s + 120))
    finally:
        stop(procs)
        server.stop()
    report(rows, args)
    if args.profile:
        profiles(args, rows)


if __name__ == "__main__":
    main()
