"""Helpers for the Redis chaos tests: a fleet on a Redis of its own (to freeze or restart), its
gateway's log kept, and calls classified by the outcome their caller saw."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import orjson

from fleet.redis_server import PrivateRedis, free_port
from tests.harness import ROOT, Fleet, wait_until


@dataclass
class OwnFleet:
    """A fleet whose Redis this test may freeze or restart; the gateway's stderr is kept."""

    redis: PrivateRedis
    fleet: Fleet
    gateway: subprocess.Popen[bytes]
    log_path: str

    @property
    def base(self) -> str:
        return self.fleet.base_url

    def gateway_log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Redis stopped dead (SIGSTOP): connections stay open, nothing answers. Always thawed."""
        assert self.redis.proc is not None
        self.redis.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.redis.proc.send_signal(signal.SIGCONT)


@contextmanager
def own_fleet() -> Iterator[OwnFleet]:
    redis = PrivateRedis().start()
    f = Fleet(redis.url)
    f.port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="fleet-gateway-", suffix=".log")
    os.close(fd)
    with open(log_path, "wb") as log:
        gw = subprocess.Popen([sys.executable, "-m", "fleetctl", "gateway", "--port", str(f.port)], env=f.env,
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    f.procs.append(gw)
    own = OwnFleet(redis, f, gw, log_path)
    try:
        wait_until(lambda: status(f"{f.base_url}/readyz") == 200, 30, what="gateway ready")
        yield own
    finally:
        # A test may have restarted Redis (own.redis is then the new server): stop both.
        servers = [redis] if own.redis is redis else [redis, own.redis]
        for server in servers:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)
        f.stop()
        for server in servers:
            server.stop()
        os.unlink(log_path)


def status(url: str, timeout: float = 2.0) -> int:
    try:
        return httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


@dataclass
class Seen:
    """One call as its caller saw it."""

    outcome: str  # completed, expired, unavailable, shed, or what went wrong ("untyped", "cut", "status NNN")
    elapsed_s: float
    deadline_ms: int
    detail: str = ""


def call(base: str, *, tier: str = "routing", stream: bool, max_tokens: int, deadline_ms: int,
         timeout_s: float = 60.0) -> Seen:
    """One chat call, classified by what the caller got: a status, a body, a stream's end. It runs to
    `max_tokens` (vLLM's `ignore_eos`), so the load is the test's, not the sim's drawn lengths."""
    body = {"model": tier, "messages": [{"role": "user", "content": "AAPL beats"}], "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}
    t0 = time.monotonic()
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout_s,
                          headers={"x-deadline-ms": str(deadline_ms)}) as r:
            raw = r.read()
    except httpx.HTTPError as e:
        return Seen("cut", time.monotonic() - t0, deadline_ms, repr(e))
    elapsed = time.monotonic() - t0
    return Seen(classify(r, raw, stream), elapsed, deadline_ms, raw[-300:].decode(errors="replace"))


def classify(r: httpx.Response, raw: bytes, stream: bool) -> str:
    if r.status_code == 200 and stream:
        events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "cut"
        last = orjson.loads(events[-2])
        if "error" in last:
            return {"service_unavailable": "unavailable", "deadline_exceeded": "expired"}.get(
                last["error"].get("type"), f"stream error {last['error'].get('type')}")
        return "completed"
    if r.status_code == 200:
        return "completed"
    try:
        err = orjson.loads(raw)["error"]
        assert err["type"] and err["message"]
    except Exception:
        return "untyped"
    if r.status_code == 503:
        return "unavailable" if err.get("code") == "redis_unavailable" and r.headers.get("retry-after") else "untyped"
    return {504: "expired", 429: "shed"}.get(r.status_code, f"status {r.status_code}")
