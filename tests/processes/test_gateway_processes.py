"""Gateways side by side: `fleet gateway --workers 3` on one port, sharing only Redis."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.redis_server import free_port
from tests.harness import Fleet, wait_until
from tests.paths import TESTS

CONFIG = TESTS / "fleet-admission.yaml"  # sk-limited: 20 requests a minute
PROCESSES = 3


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _served(metrics_port: int) -> int:
    """Chat calls this one process answered, by their final outcome (shed included)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r"^fleet_requests_total{[^}]*} ([0-9.e+]+)$", text, re.M)))


def _bindable(port: int) -> bool:
    try:
        with socket.create_server(("127.0.0.1", port)):
            return True
    except OSError:
        return False


@pytest.fixture
def gateways(redis_url: str) -> Iterator[tuple[Fleet, int]]:
    f = Fleet(redis_url, config_path=CONFIG)
    metrics = free_port()
    while not all(_bindable(metrics + i) for i in range(PROCESSES)):  # P..P+2, one per process
        metrics = free_port()
    try:
        f.start_gateway("--workers", str(PROCESSES), "--metrics-port", str(metrics))
        f.start_worker("fast")
        yield f, metrics
    finally:
        f.stop()


def test_a_20_rpm_key_gets_exactly_20_of_60_calls_spread_over_three_gateway_processes(
        gateways: tuple[Fleet, int]) -> None:
    f, metrics = gateways
    parent = f.procs[0]
    kids = wait_until(lambda: len(_children(parent.pid)) == PROCESSES and _children(parent.pid), 20,
                      what="three gateway processes")
    for i in range(PROCESSES):  # every process is up (each answers on its own metrics port)
        wait_until(lambda i=i: _served(metrics + i) >= 0, 20, what=f"gateway process {i}")

    async def burst() -> list[httpx.Response]:
        # A fresh connection per call, so the kernel spreads them over the processes.
        async def one() -> httpx.Response:
            async with httpx.AsyncClient(base_url=f.base_url, timeout=60) as c:
                return await c.post("/v1/chat/completions", headers={"authorization": "Bearer sk-limited"},
                                    json={"model": "fast", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "classify: AAPL"}]})
        return await asyncio.gather(*(one() for _ in range(60)))

    out = asyncio.run(burst())
    assert sum(r.status_code == 200 for r in out) == 20
    refused = [r for r in out if r.status_code != 200]
    assert len(refused) == 40 and all(r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
                                      for r in refused)
    per_process = [_served(metrics + i) for i in range(PROCESSES)]
    assert sum(per_process) == 60, per_process
    assert sum(1 for n in per_process if n > 0) >= 2, per_process  # more than one process took calls

    # SIGTERM to the parent stops every process.
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(60) == 0
    wait_until(lambda: not any(Path(f"/proc/{k}").exists() for k in kids), 20, what="the children gone")


def test_a_taken_port_is_one_clear_error_before_any_process_starts(redis_url: str) -> None:
    f = Fleet(redis_url, config_path=CONFIG)
    with socket.create_server(("127.0.0.1", 0)) as taken:  # not SO_REUSEPORT: nobody may share it
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "fleetctl", "gateway", "--workers", "2", "--port", str(port)],
                           env=f.env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cannot listen" in p.stderr, p.stderr
