"""`fleet up`: the whole fleet from one command, serving every tier, draining on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import openai

from fleet.redis_server import free_port
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
