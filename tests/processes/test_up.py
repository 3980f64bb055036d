"""`fleet up`: the whole fleet from one command, serving every tier, draining on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import openai
import pytest

from fleet.redis_server import PrivateRedis, free_port
from tests.cluster_harness import PrivateCluster
from tests.harness import ROOT, TEST_CONFIG, Fleet, wait_until


def test_fleet_up_serves_each_tier_and_stops_cleanly(fleet: Fleet) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fleetctl", "up", "--port", str(port), "--config",
                             str(TEST_CONFIG)], env=fleet.env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        def ready() -> bool:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            lines.append(line)
            return "is up at" in line or proc.poll() is not None

        wait_until(ready, 120, interval=0, what="fleet up")
        assert proc.poll() is None, "".join(lines)
        assert any("starting" in ln for ln in lines), "no progress shown during cold start"
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for tier in ("routing", "analysis", "planner"):
            chunks = list(c.chat.completions.create(model=tier, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3, stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).split()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code in (0, 1), "".join(lines)
    # Every worker drained and left: no replica heartbeats remain.
    for tier in ("routing", "analysis", "planner"):
        assert fleet.r.hlen(fleet.keys(tier).replicas) == 0


# --- a Redis fault while `fleet up` shows its start-up -------------------------------------------

SLOW_PLANNER = {"FLEET_TIERS__PLANNER__SIM__WARMUP_S": "6"}  # a cold start long enough to fault Redis in


class Up:
    """`fleet up` on `url` as a subprocess, its output read line by line as it comes."""

    def __init__(self, url: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "fleetctl", "up", "--port", str(self.port), "--config",
                                      str(TEST_CONFIG)], env={**env, "REDIS_URL": url, **SLOW_PLANNER}, cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def until(self, words: str, timeout: float) -> None:
        """Read output until a line holds `words` (or `fleet up` exits: then fail, showing what it said)."""
        def seen() -> bool:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            self.lines.append(line)
            return words in line or self.proc.poll() is not None

        wait_until(seen, timeout, interval=0, what=repr(words), why=lambda: "".join(self.lines[-20:]))
        assert self.proc.poll() is None, "fleet up exited:\n" + "".join(self.lines)

    def serves_every_tier(self) -> None:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=30)
        for tier in ("routing", "analysis", "planner"):
            def served(t: str = tier) -> bool:
                try:
                    r = c.chat.completions.create(model=t, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
                    return r.usage.completion_tokens == 3  # type: ignore[union-attr]
                except openai.APIError:  # 503 while a part reconnects
                    return False
            wait_until(served, 60, interval=0.5, what=f"{tier} served after the fault")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()


def test_a_redis_restart_during_start_up_does_not_take_the_fleet_down() -> None:
    server = PrivateRedis().start()
    up = Up(server.url, Fleet(server.url).env)
    try:
        up.until("starting", 60)  # replicas paying their cold start
        server.stop()
        up.until("Redis does not answer", 30)
        server = PrivateRedis(port=server.port).start()  # the same address, empty
        up.until("is up at", 120)
        assert up.proc.poll() is None
        up.serves_every_tier()
        assert any("Redis answers again" in ln for ln in up.lines), "".join(up.lines)
    finally:
        code = up.stop()
        server.stop()
    assert code in (0, 1), "".join(up.lines)


@pytest.mark.timeout(240)
def test_a_cluster_master_killed_during_start_up_does_not_take_the_fleet_down() -> None:
    cluster = PrivateCluster().start()
    f = Fleet(cluster.url)
    up = Up(cluster.url, f.env)
    try:
        up.until("routing 1/1 ready", 60)  # one tier answers, the planner still starts
        cluster.kill(cluster.master_of(f.keys("routing").line))
        wait_until(cluster.healthy, 30, interval=0.1, what="a replica promoted")
        up.until("is up at", 120)
        up.serves_every_tier()
    finally:
        code = up.stop()
        cluster.stop()
    assert code in (0, 1), "".join(up.lines)
