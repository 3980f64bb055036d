"""The spend ledger survives restarts of the gateway and the workers (real processes),
and a restarted replica under the same id is never charged twice for the same second."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from redis.asyncio import Redis

from fleet.store.ledger import Ledger, Spend
from tests.harness import TEST_CONFIG, Fleet, wait_until

TIER = "routing"


def totals(f: Fleet) -> Spend:
    async def read() -> Spend:
        r = Redis.from_url(f.redis_url)
        try:
            return await Ledger(r, f.namespace, TIER, f.cfg.tiers[TIER]).totals()
        finally:
            await r.aclose()

    return asyncio.run(read())


def status(f: Fleet) -> dict[str, Any]:
    return httpx.get(f"{f.base_url}/v1/fleet/status", timeout=10).json()["tiers"][TIER]


def calls(f: Fleet, n: int) -> int:
    """n committed calls; returns the completion tokens served."""
    served = 0
    for _ in range(n):
        r = httpx.post(f"{f.base_url}/v1/chat/completions", headers={"X-Priority": "committed"}, timeout=30,
                       json={"model": TIER, "messages": [{"role": "user", "content": "route"}], "max_tokens": 5})
        assert r.status_code == 200, r.text
        served += r.json()["usage"]["completion_tokens"]
    return served


def test_ledger_survives_restarts_and_counts_each_second_once(redis_url: str, tmp_path: Path) -> None:
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["tiers"][TIER].update(hourly_usd=3600.0, usd_per_million_tokens=100.0)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    f = Fleet(redis_url, config_path=path)
    try:
        t0 = time.time()
        f.start_gateway()
        gateway: subprocess.Popen[bytes] = f.procs[-1]
        f.start_worker(TIER, "routing-1")
        useful = calls(f, 3)
        wait_until(lambda: totals(f).useful_tokens == useful, 10, what="tokens in the ledger")
        # The status shows the budget governor's last judgement (at most a tick old).
        judged = wait_until(lambda: (s := status(f))["tokens_today"] and s["tokens_today"]["useful"] == useful and s,
                            10, what="the governor's judgement of the tokens")
        spend_before = judged["spend_usd"]
        assert spend_before > 0

        # Both parts die: the worker without a goodbye, the gateway cleanly.
        f.kill_worker("routing-1", signal.SIGKILL)
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(15)
        before = totals(f)
        assert before.useful_tokens == useful and before.replica_s["starting"] > 0 and before.replica_s["ready"] > 0
        time.sleep(0.5)
        assert totals(f).usd == before.usd  # nothing accrues while nothing runs

        # Back up; the supervisor reuses the replica id for the new process.
        f.start_gateway()
        f.start_worker(TIER, "routing-1")
        useful += calls(f, 2)
        wait_until(lambda: totals(f).useful_tokens == useful, 10, what="new tokens on top of the old")
        after = totals(f)
        assert after.tokens > before.tokens and after.usd > before.usd
        assert after.replica_s["starting"] > before.replica_s["starting"]  # the second cold start is billed too
        # Never more replica-seconds than one replica at a time could have run since the first start.
        assert sum(after.replica_s.values()) <= time.time() - t0 + 0.5
        now = wait_until(lambda: (s := status(f))["tokens_today"] and s["tokens_today"]["useful"] == useful and s,
                         10, what="the governor's judgement of the new tokens")
        assert now["spend_usd"] >= spend_before + (after.usd - before.usd) - 0.5
        assert now["spend_lifetime_usd"] == pytest.approx(totals(f).usd, abs=5.0)
    finally:
        f.stop()
