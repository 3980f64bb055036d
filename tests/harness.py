"""Real processes for the tests: a gateway and workers as `fleet` subprocesses
against a private redis-server, each test in its own namespace."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
import yaml

from fleet.config import FleetConfig, Priority, load_config
from fleet.redis_server import free_port
from fleet.store.connection import connect_sync
from fleet.store.keys import TierKeys
from fleet.store.line import Line
from fleet.store.payloads import CallPayload

ROOT = Path(__file__).resolve().parent.parent
TEST_CONFIG = Path(__file__).resolve().parent / "fleet-test.yaml"


def wait_until(pred, timeout: float = 20.0, interval: float = 0.05, what="condition", why=None):  # type: ignore[no-untyped-def]
    """Poll `pred` until true; on timeout fail naming `what`, and what `why()` (when given) says of
    the state then, so a failure shows what was wrong, not only that it was."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f": {why()}" if why else ""))


async def until(pred, what: str, within_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """`wait_until` for a test's event loop: poll `pred` (plain or a coroutine function) until true."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {within_s}s waiting for {what}")


async def blocked_in(r: Any, name: str, cmd: str, limit_s: float = 10.0) -> None:
    """Until Redis says a connection whose client name starts with `name` is blocked in `cmd`
    (CLIENT LIST flag `b`): only then is something done "while it waits" done while it waits."""
    end = time.monotonic() + limit_s
    seen: list[tuple[str, str]] = []
    while time.monotonic() < end:
        seen = [(str(c.get("cmd")), str(c.get("flags"))) for c in await r.client_list()
                if str(c.get("name", "")).startswith(name)]
        if any(c == cmd and "b" in flags for c, flags in seen):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"no connection named {name!r} blocked in {cmd} within {limit_s} s: {seen}")


def redis_bytes(r: redis.Redis, match: str) -> int:
    """What the keys matching `match` (e.g. "ns:*") hold in Redis now: MEMORY USAGE summed over
    them (over every node of a cluster)."""
    total = 0
    for key in r.scan_iter(match=match, count=1000):
        total += int(r.memory_usage(key, samples=0) or 0)  # a key gone between SCAN and MEMORY is 0
    return total


def config_variant(base: Path, out_dir: Path, tier: str, section: str | None = None, **fields: Any) -> Path:
    """A copy of the config `base` (same file name) in `out_dir`, with `fields` set on `tier`
    or, given `section`, on that part of it (e.g. its `rollout`)."""
    cfg = yaml.safe_load(base.read_text())
    target = cfg["tiers"][tier] if section is None else cfg["tiers"][tier][section]
    target.update(fields)
    p = out_dir / base.name
    p.write_text(yaml.safe_dump(cfg))
    return p

def call_payload(prompt: str = "route this", max_tokens: int = 10, *, kind: str = "completion", stream: bool = False,
                 key: str = "", **fields: Any) -> bytes:
    """A call's payload as the gateway writes it (`fleet.store.payloads`), for tests that put calls on
    the line themselves: a completion of `prompt` (or, with kind="chat", one user turn of it). It runs
    to exactly `max_tokens` (vLLM's `ignore_eos`, unless `ignore_eos=False`): the tests' loads and
    counts are theirs, not the sim's drawn answer lengths."""
    body: dict[str, Any] = {"model": "any", "max_tokens": max_tokens, "ignore_eos": True, **fields}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return CallPayload.encode(kind, orjson.dumps(body), max_tokens=max_tokens, key=key, stream=stream)  # type: ignore[arg-type]


async def enqueue_many(line: Line, prio: Priority, n: int = 1, deadline_ms: int = 30_000) -> list[str]:
    """Put `n` requests of class `prio` on the line (bodies numbered 0..n-1); their ids in arrival order."""
    ids = []
    for _ in range(n):
        rid = uuid.uuid4().hex
        await line.enqueue(rid, prio, orjson.dumps({"n": len(ids)}), deadline_ms)
        ids.append(rid)
    return ids

@dataclass
class Fleet:
    """A fleet under test. Everything it starts, it stops."""

    redis_url: str
    config_path: Path = TEST_CONFIG
    env_overrides: dict[str, str] = field(default_factory=dict)
    namespace: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    port: int = 0
    _r: redis.Redis | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "REDIS_URL": self.redis_url, "FLEET_CONFIG": str(self.config_path),
                "FLEET_NAMESPACE": self.namespace, "PYTHONUNBUFFERED": "1", **self.env_overrides}

    @property
    def cfg(self) -> FleetConfig:
        old = dict(os.environ)
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("FLEET_")})
        try:
            return load_config(self.config_path)
        finally:
            os.environ.clear()
            os.environ.update(old)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def r(self) -> redis.Redis:
        """A blocking client of the fleet's Redis (single server or cluster), made once."""
        if self._r is None:
            self._r = connect_sync(self.redis_url)
        return self._r

    def keys(self, tier: str) -> TierKeys:
        return TierKeys(self.namespace, tier)

    def spawn(self, *args: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-m", "fleetctl", *args], env=self.env, cwd=ROOT)
        self.procs.append(p)
        return p

    def start_gateway(self, *extra: str) -> Fleet:
        self.port = free_port()
        self.spawn("gateway", "--port", str(self.port), *extra)
        wait_until(self._gateway_ready, 20, what="gateway /readyz")
        return self

    def _gateway_ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start_worker(self, tier: str, replica_id: str | None = None, *, wait: bool = True, **extra: str) -> str:
        rid = replica_id or f"{tier}-{uuid.uuid4().hex[:6]}"
        args = ["worker", "--tier", tier, "--replica-id", rid]
        for k, v in extra.items():
            args += [f"--{k.replace('_', '-')}", v]
        self.workers[rid] = self.spawn(*args)
        if wait:
            wait_until(lambda: self.replica_state(tier, rid) == "ready", 60, what=f"replica {rid} ready")
        return rid

    def start_tiers(self, tiers: tuple[str, ...] | list[str], timeout: float = 60) -> Fleet:
        """One worker a tier, started together (they load in parallel), then each waited for."""
        started = [(tier, self.start_worker(tier, wait=False)) for tier in tiers]
        for tier, rid in started:
            wait_until(lambda t=tier, r=rid: self.replica_state(t, r) == "ready", timeout,
                       what=f"replica {rid} ready")
        return self

    def replica_state(self, tier: str, rid: str) -> str | None:
        raw = self.r.hget(self.keys(tier).replicas, rid)
        return orjson.loads(raw)["state"] if raw else None

    def kill_worker(self, rid: str, sig: int = signal.SIGKILL) -> None:
        p = self.workers[rid]
        p.send_signal(sig)
        p.wait(30)

    def counters(self, tier: str) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.keys(tier).counters).items()}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@contextlib.contextmanager
def serving(redis_url: str, tiers: tuple[str, ...] = ("routing",), **fleet: Any) -> Iterator[Fleet]:
    """A fleet with its gateway up and one ready worker a tier; everything stopped at the end.
    The fixture most process tests share (`fleet` is a `Fleet` field: config_path, env_overrides)."""
    f = Fleet(redis_url, **fleet)
    try:
        f.start_gateway()
        f.start_tiers(tiers)
        yield f
    finally:
        f.stop()


@contextlib.contextmanager
def scaled_fleet(url: str, config: Path, tier: str) -> Iterator[Fleet]:
    """A fleet whose scalers start replicas. After the test it is stopped (SIGTERM: each scaler drains
    the replicas it holds, --stop-replicas-on-exit), and replicas a test orphaned on purpose (by
    killing their scaler) that nobody drained are ended by pid."""
    f = Fleet(url, config_path=config)
    try:
        yield f
    finally:
        f.stop()
        for raw in f.r.hvals(f.keys(tier).supervised):
            rec = orjson.loads(raw)
            pid, rid = rec.get("pid"), rec["id"]
            with contextlib.suppress(OSError):
                if pid and rid.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


class LineLoad:
    """A steady load on a tier's line from a thread, as the gateway would enqueue: `rate` requests
    a second until the `with` block ends; `sent` counts them."""

    def __init__(self, redis_url: str, namespace: str, tier: str, rate: float, deadline_ms: int) -> None:
        import threading

        self.redis_url, self.namespace, self.tier = redis_url, namespace, tier
        self.rate, self.deadline_ms, self.sent = rate, deadline_ms, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._thread, daemon=True)

    def _thread(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        from redis.asyncio import Redis

        from fleet.store.line import Line

        r = Redis.from_url(self.redis_url)
        line = Line(r, self.namespace, self.tier, rate_window_s=4.0)
        payload = call_payload()
        t0 = time.monotonic()
        while not self.stop.is_set():
            await line.enqueue(uuid.uuid4().hex, Priority.interactive, payload, self.deadline_ms)
            self.sent += 1
            await asyncio.sleep(max(0.0, t0 + self.sent / self.rate - time.monotonic()))
        await r.aclose()

    def __enter__(self) -> LineLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
