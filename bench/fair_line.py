"""What the fair line costs Redis: CPU per call of ENQUEUE and CLAIM (and FINISH), fair against
fifo, measured in the same run on a private redis-server.

Each round puts `--calls` calls on a tier's line from `--flows` flows (round robin, so each
flow is backlogged), keeping about `--backlog` waiting, claims them one by one as a worker
does, and finishes each. Redis CPU (INFO cpu, user + sys) over the round, per call; the
ratio fair / fifo is the figure (the issue's bound: at most 1.2 for enqueue plus claim).

    .venv/bin/python bench/fair_line.py [--calls 20000] [--flows 50] [--backlog 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.config import Priority  # noqa: E402
from fleet.redis_server import PrivateRedis  # noqa: E402
from fleet.store.connection import connect  # noqa: E402
from fleet.store.events import Done  # noqa: E402
from fleet.store.flows import Place  # noqa: E402
from fleet.store.line import Line  # noqa: E402

PAYLOAD = b'{"kind":"chat","max_tokens":16,"key":"bench","stream":false,"body":{"messages":[]}}'


def redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def one_round(url: str, fair: bool, calls: int, flows: int, backlog: int, sync: redis.Redis) -> dict[str, float]:
    """Redis CPU seconds per call, split by what ran: enqueue, claim, finish."""
    r = connect(url)
    line = Line(r, f"b{uuid.uuid4().hex[:6]}", "routing")
    spent = {"enqueue": 0.0, "claim": 0.0, "finish": 0.0}

    async def timed(what: str, coro):  # type: ignore[no-untyped-def]
        c0 = redis_cpu(sync)
        out = await coro
        spent[what] += redis_cpu(sync) - c0
        return out

    # Batches, so INFO's own cost is small against what it measures.
    batch, sent = 200, 0
    while sent < calls:
        n = min(batch, calls - sent)

        async def put(k: int, at: int = sent) -> None:
            rid = uuid.uuid4().hex
            place = Place(f"key:f{(at + k) % flows}", 60, 60.0) if fair else None
            await line.enqueue(rid, Priority.interactive, PAYLOAD, 60_000, place=place)

        await timed("enqueue", asyncio.gather(*(put(k) for k in range(n))))
        sent += n
        if sent < backlog:
            continue
        claimed = await timed("claim", asyncio.gather(*(line.claim("w", 1, 30) for _ in range(n))))
        held = [c for cs in claimed for c in cs]
        await timed("finish", asyncio.gather(*(line.finish(c.rid, "completed", Done(16, "stop", {}), owner=c.owner,
                                                           prompt_tokens=8, completion_tokens=16) for c in held)))
    await r.aclose()
    return {k: v / calls for k, v in spent.items()}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--flows", type=int, default=50)
    ap.add_argument("--backlog", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    server = PrivateRedis().start()
    try:
        sync = redis.Redis.from_url(server.url)
        got: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(a.rounds):  # interleaved, so drift on a shared machine hits both alike
            for fair in (False, True):
                got[fair].append(await one_round(server.url, fair, a.calls, a.flows, a.backlog, sync))
        print(f"{a.calls} calls a round, {a.flows} flows, ~{a.backlog} waiting, {a.rounds} rounds (median)")
        print(f"{'':8} {'enqueue us':>11} {'claim us':>9} {'finish us':>10} {'enq+claim':>10}")
        med = {}
        for fair in (False, True):
            rows = got[fair]
            m = {k: sorted(x[k] for x in rows)[len(rows) // 2] * 1e6 for k in rows[0]}
            med[fair] = m
            print(f"{'fair' if fair else 'fifo':8} {m['enqueue']:11.1f} {m['claim']:9.1f} {m['finish']:10.1f} "
                  f"{m['enqueue'] + m['claim']:10.1f}")
        f, b = med[True], med[False]
        print(f"fair / fifo: enqueue {f['enqueue'] / b['enqueue']:.2f}x, claim {f['claim'] / b['claim']:.2f}x, "
              f"enqueue + claim {(f['enqueue'] + f['claim']) / (b['enqueue'] + b['claim']):.2f}x, "
              f"all three {sum(f.values()) / sum(b.values()):.2f}x")
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
