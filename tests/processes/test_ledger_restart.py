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


def charged(f: Fleet, replica: str) -> tuple[int, int, int]:
    """(replica-milliseconds the ledger charged in all, `replica`'s last mark in ms, the process
    start in ms of the incarnation that made it), read in one transaction so that no beat falls
    between the total and the mark."""
    k = f.keys(TIER)
    with f.r.pipeline(transaction=True) as p:
        p.hgetall(k.ledger_total)
        p.hget(k.ledger_beats, replica)
        total, mark = p.execute()
    ms = sum(int(v) for name, v in total.items() if name.startswith(b"rs:"))
    at, _, born = mark.decode().split("|")
    return ms, int(at), int(born)


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
        # Exactly the first incarnation's life: from its process start to its last beat.
        ms1, mark1, born1 = charged(f, "routing-1")
        assert ms1 == mark1 - born1
        time.sleep(0.5)  # a stretch with nothing running; the gateway's restart below adds to it
        assert totals(f).usd == before.usd  # nothing accrues while nothing runs (the exact check follows)

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
        # Nor any for the time nothing ran, charged late by the new incarnation: a sleep and a look
        # above could not show that. The ledger holds exactly the two lives, and the gap between
        # them (at least the 0.5 s and the gateway's restart) is in neither.
        ms2, mark2, born2 = charged(f, "routing-1")
        assert born2 - mark1 >= 500, (mark1, born2)  # a gap long enough that charging it would show
        assert ms2 == ms1 + (mark2 - born2), (ms1, ms2, mark2 - born2, born2 - mark1)
        now = wait_until(lambda: (s := status(f))["tokens_today"] and s["tokens_today"]["useful"] == useful and s,
                         10, what="the governor's judgement of the new tokens")
        assert now["spend_usd"] >= spend_before + (after.usd - before.usd) - 0.5
        assert now["spend_lifetime_usd"] == pytest.approx(totals(f).usd, abs=5.0)
    finally:
        f.stop()
