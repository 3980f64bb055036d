"""Committed TTFT when a tier's slots are full of background work: with and without
preemption, against the TTFT of the same committed calls on an idle replica, in one run.

Each phase starts one replica (the worker with the sim engine, in this process) on a
private redis-server. `idle`: committed calls alone. `full`: 512-token background
generations fill every slot, with a backlog of them kept in the line all phase; the
same committed calls, one every `--gap` seconds, with preemption off and then on.
TTFT is the caller's: from joining the line to the first token in its result stream.
Every background call must still complete, with its exact token count.

    .venv/bin/python bench/preemption.py [--calls 20] [--gap 1] [--slots 4] [--bg-tokens 512]
        [--max-preemptions 3] [--time-scale 1] [--shipped] [--burst 1]

--shipped takes the planner of configs/fleet.yaml as it ships (its slots, decode step and
preemption settings, reserved slot included; only the model load is skipped) for the run with
preemption, and the same tier with preemption off and no reserved slot (the old default) for
the run without. --burst 2 sends committed calls two at once: with one slot reserved, the
second must preempt.

Goal (issue 16): with the slots full, committed p99 <= 2 x its p99 on an idle replica.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

import orjson
from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.config import (  # noqa: E402
    DEFAULT_CONFIG,
    DecodeStep,
    FleetConfig,
    Preemption,
    Priority,
    SimProfile,
    TierConfig,
    load_config,
)
from fleet.redis_server import PrivateRedis  # noqa: E402
from fleet.store.events import Chunk, Done, Failed  # noqa: E402
from fleet.store.line import Line  # noqa: E402
from fleet.store.payloads import CallPayload  # noqa: E402
from workers.engines.sim import SimEngine  # noqa: E402
from workers.worker import Worker  # noqa: E402

TIER = "planner"


def shipped_config(preempt: bool) -> FleetConfig:
    """The shipped planner, its model load skipped; with its own preemption settings, or none at all."""
    tc = load_config(DEFAULT_CONFIG).tiers[TIER].model_copy(deep=True)
    tc.sim.weights_gb, tc.sim.warmup_s = 0, 0
    if not preempt:
        tc.preemption = Preemption(enabled=False)
    return FleetConfig(namespace=f"bench{uuid.uuid4().hex[:6]}", tiers={TIER: tc}, heartbeat_s=1.0)


def fleet_config(slots: int, preempt: bool, max_preemptions: int) -> FleetConfig:
    # A planner-like replica: 20 ms decode steps, so one 512-token generation holds a slot ~12 s.
    sim = SimProfile(weights_gb=0, warmup_s=0, prefill_tokens_per_s=20000,
                     decode_step=DecodeStep(base_s=0.02, per_seq_s=0.001), kv_capacity_tokens=1 << 20)
    pre = Preemption(enabled=preempt, max_preemptions=max_preemptions)
    tc = TierConfig(slots=slots, lease_s=10, sim=sim, preemption=pre)
    return FleetConfig(namespace=f"bench{uuid.uuid4().hex[:6]}", tiers={TIER: tc}, heartbeat_s=1.0)


async def call(line: Line, prio: Priority, max_tokens: int, stream: bool) -> tuple[float, int]:
    """One call through the line: (TTFT seconds, completion tokens)."""
    rid = uuid.uuid4().hex
    body = orjson.dumps({"model": TIER, "prompt": "x" * 800, "max_tokens": max_tokens, "ignore_eos": True})
    payload = CallPayload.encode("completion", body, max_tokens=max_tokens, key="", stream=stream)
    t0 = time.monotonic()
    await line.enqueue(rid, prio, payload, 3_600_000)
    ttft, after = 0.0, "0-0"
    while True:
        for entry, ev in await line.read_events(rid, after, 5000):
            after = entry
            if isinstance(ev, Chunk) and not ttft:
                ttft = time.monotonic() - t0
            elif isinstance(ev, Done):
                await line.drop_events(rid)
                return ttft or ev.ttft_s + ev.wait_s, ev.completion_tokens
            elif isinstance(ev, Failed):
                raise RuntimeError(f"call failed: {ev}")


async def phase(url: str, *, slots: int, preempt: bool, background: bool, bg_tokens: int, calls: int,
                gap_s: float, time_scale: float, max_preemptions: int, shipped: bool = False,
                burst: int = 1) -> tuple[list[float], int, int, int]:
    """Committed TTFTs, background calls (completed with exact tokens, in all) and preemptions, for one phase."""
    cfg = shipped_config(preempt) if shipped else fleet_config(slots, preempt, max_preemptions)
    slots = cfg.tiers[TIER].slots
    held = slots - cfg.tiers[TIER].preemption.reserved_slots.get("committed", 0)  # what background may hold
    redis = Redis.from_url(url)
    line = Line(redis, cfg.namespace, TIER, result_ttl_s=600)
    worker = Worker(cfg, TIER, SimEngine(cfg.tiers[TIER].sim, time_scale=time_scale), redis)
    run = asyncio.create_task(worker.run())
    while worker.state != "ready":  # noqa: ASYNC110 (the worker has no event for it)
        await asyncio.sleep(0.01)
    bg: list[asyncio.Task[tuple[float, int]]] = []
    feeding = asyncio.Event()

    async def feed() -> None:
        # Every slot busy with background work and a backlog of it in the line, all phase long.
        while feeding.is_set():
            if (await line.observe()).by_class[Priority.background] < slots:
                bg.extend(asyncio.create_task(call(line, Priority.background, bg_tokens, False))
                          for _ in range(slots))
            await asyncio.sleep(0.05)

    if background:
        feeding.set()
        feeder = asyncio.create_task(feed())
        while (await line.observe()).inflight < held:  # noqa: ASYNC110 (Redis is polled)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5 * time_scale)
    ttfts: list[float] = []
    for _ in range(0, calls, burst):
        for ttft, ct in await asyncio.gather(*(call(line, Priority.committed, 16, True) for _ in range(burst))):
            assert ct == 16
            ttfts.append(ttft)
        await asyncio.sleep(gap_s * time_scale)
    if background:
        feeding.clear()
        await feeder
    exact = sum(1 for _, ct in await asyncio.gather(*bg) if ct == bg_tokens)
    preempted = (await line.observe()).counters.get("preempted", 0)
    worker.drain()
    await run
    await redis.aclose()
    return ttfts, exact, len(bg), preempted


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20, help="committed calls per phase")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--bg-tokens", type=int, default=512)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between committed calls")
    ap.add_argument("--time-scale", type=float, default=1.0, help="< 1 runs the sim engine faster than life")
    ap.add_argument("--max-preemptions", type=int, default=3)
    ap.add_argument("--shipped", action="store_true", help="the planner of configs/fleet.yaml as it ships")
    ap.add_argument("--burst", type=int, default=1, help="committed calls sent at once, every --gap")
    a = ap.parse_args()
    server = PrivateRedis().start()
    try:
        common = {"slots": a.slots, "bg_tokens": a.bg_tokens, "calls": a.calls, "gap_s": a.gap,
                  "time_scale": a.time_scale, "max_preemptions": a.max_preemptions, "shipped": a.shipped,
                  "burst": a.burst}
        idle, _, _, _ = await phase(server.url, preempt=False, background=False, **common)
        off, off_ok, off_n, _ = await phase(server.url, preempt=False, background=True, **common)
        on, on_ok, on_n, n = await phase(server.url, preempt=True, background=True, **common)
    finally:
        server.stop()
    base = pct(idle, 0.99)
    what = ("the shipped planner (configs/fleet.yaml)" if a.shipped
            else f"{a.slots} slots, max_preemptions {a.max_preemptions}")
    print(f"committed TTFT over {a.calls} calls, every slot full of {a.bg_tokens}-token background work "
          f"({what}, time scale {a.time_scale:g})")
    print(f"{'phase':<22}{'p50 ms':>10}{'p99 ms':>10}{'p99 / idle p99':>16}")
    for name, xs in (("idle replica", idle), ("full, no preemption", off), ("full, preemption", on)):
        print(f"{name:<22}{statistics.median(xs) * 1000:>10.1f}{pct(xs, 0.99) * 1000:>10.1f}"
              f"{pct(xs, 0.99) / base:>16.2f}")
    print(f"preemptions: {n}; background completed with exact tokens: {off_ok}/{off_n} without, "
          f"{on_ok}/{on_n} with preemption")
    print(f"goal p99 <= 2 x idle: {'met' if pct(on, 0.99) <= 2 * base else 'NOT met'}")


if __name__ == "__main__":
    asyncio.run(main())
