"""The scaler tests' fleet config and readers: what a live scaler published, its decisions, the
replicas' beats, and a burst put straight on the line (the fixture, `sfleet`, is in
tests/processes/conftest.py)."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from typing import Any

import orjson
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.store.line import Line
from tests.harness import Fleet, call_payload
from tests.paths import TESTS

SCALER_CONFIG = TESTS / "fleet-scaler.yaml"
TIER = "routing"
HOLD_S = 3.0  # scale_in_hold_s in fleet-scaler.yaml
ADMIN = {"authorization": "Bearer sk-admin"}


def start_scaler(f: Fleet, *extra: str) -> subprocess.Popen[bytes]:
    return f.spawn("scaler", "--tick", "0.25", "--lease", "2", "--metrics-port", "0", "--stop-replicas-on-exit",
                   *extra)


def published(f: Fleet) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in f.r.hgetall(f.keys(TIER).scaler).items()}


def stream(f: Fleet, since: float = 0.0) -> list[dict[str, str]]:
    out = []
    for _, fields in f.r.xrange(f.keys(TIER).decisions):
        e = {k.decode(): v.decode() for k, v in fields.items()}
        if float(e["at"]) >= since:
            out.append(e)
    return out


def heartbeats(f: Fleet) -> dict[str, dict[str, Any]]:
    now = time.time()
    beats = {k.decode(): orjson.loads(v) for k, v in f.r.hgetall(f.keys(TIER).replicas).items()}
    # Lenient about a late beat (a loaded machine); the dead are removed by their worker or the supervisor.
    return {k: b for k, b in beats.items() if now - b["ts"] < 5.0}


def ready(f: Fleet) -> set[str]:
    return {k for k, b in heartbeats(f).items() if b["state"] == "ready"}


def burst(f: Fleet, n: int, max_tokens: int = 10) -> None:
    async def go() -> None:
        r = Redis.from_url(f.redis_url)
        line = Line(r, f.namespace, TIER, rate_window_s=4.0)
        payload = call_payload(max_tokens=max_tokens)
        await asyncio.gather(*(line.enqueue(uuid.uuid4().hex, Priority.interactive, payload, 60_000)
                               for _ in range(n)))
        await r.aclose()

    asyncio.run(go())
