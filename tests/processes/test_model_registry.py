"""The model registry's command (`fleet models|promote|rollback`) on a real Redis: lists, shows,
promotes, rolls back, prints the history, and names what it refuses. The registry itself and the
admin API: tests/store/test_model_registry.py."""

from __future__ import annotations

import subprocess
import sys
import uuid

from tests.harness import ROOT
from tests.paths import TESTS

CONFIG = TESTS / "fleet-rollout.yaml"
TIER = "routing"


def _fleet(redis_url: str, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"REDIS_URL": redis_url, "FLEET_CONFIG": str(CONFIG), "FLEET_NAMESPACE": namespace,
           "PATH": "/usr/bin:/bin", "USER": "tester"}
    return subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_the_command_lists_shows_promotes_rolls_back_and_prints_the_history(redis_url: str) -> None:
    ns = f"t{uuid.uuid4().hex[:10]}"
    out = _fleet(redis_url, ns, "models", "list")
    assert out.returncode == 0, out.stderr
    assert "routing" in out.stdout and "v1" in out.stdout and "v1,v2,v3" in out.stdout

    out = _fleet(redis_url, ns, "promote", TIER, "v2", "--why", "faster decode", "--canary", "1")
    assert out.returncode == 0, out.stderr
    assert "v2 is live (was v1)" in out.stdout and "canary 1" in out.stdout
    out = _fleet(redis_url, ns, "models", "show", TIER)
    assert out.returncode == 0 and "live v2, previous v1" in out.stdout and "promote v1 -> v2" in out.stdout

    bad = _fleet(redis_url, ns, "promote", TIER, "v9")
    assert bad.returncode == 1 and "unknown version 'v9'" in bad.stderr and "Traceback" not in bad.stderr
    bad = _fleet(redis_url, ns, "promote", "nope", "v2")
    assert bad.returncode == 2 and "unknown tier 'nope'" in bad.stderr

    out = _fleet(redis_url, ns, "rollback", TIER)
    assert out.returncode == 0 and "v1 is live again (was v2)" in out.stdout
    out = _fleet(redis_url, ns, "models", "history", TIER)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and "seed" in lines[0]
    assert "promote" in lines[1] and "v1 -> v2" in lines[1] and "faster decode" in lines[1] and "tester@" in lines[1]
    assert "rollback" in lines[2] and "v2 -> v1" in lines[2]
    bad = _fleet(redis_url, ns, "rollback", TIER, "--to", "v1")
    assert bad.returncode == 1 and "already live" in bad.stderr
    away = _fleet("redis://127.0.0.1:1", ns, "models", "list")  # nothing listens there
    assert away.returncode == 1 and "cannot reach Redis" in away.stderr and "Traceback" not in away.stderr
