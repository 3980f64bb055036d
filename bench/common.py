"""What the bench scripts share: a zero-latency sim tier, starting the fleet's parts, stopping them, figures.

The scripts run as `python bench/x.py`: each puts the repository root on `sys.path` and then
imports this module as `bench.common`.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def zero_tier(name: str, slots: int | str = 128) -> str:
    """The YAML of one tier whose `sim` replica costs nothing: no weights, no warm-up, an instant
    prefill and decode step, so what is measured is the fleet's own overhead. `slots` may be a
    `%(...)d` placeholder for a template formatted later."""
    return f"""  {name}:
    warm_floor: 1
    max_replicas: 1
    slots: {slots}
    sim:
      weights_gb: 0
      load_gb_s: 1
      warmup_s: 0
      prefill_tokens_per_s: 1.0e12
      decode_step: {{base_s: 0, per_seq_s: 0}}
      kv_capacity_tokens: 10000000
"""



def paced_fleet(tier: str, *, slots: int | str, step_s: float | str, tokens: int | str, replicas: int = 1) -> str:
    """A fleet config for many long open calls: namespace `bench`, deadlines and wait limits out
    of the way, no cap on one client's connections, and one `sim` tier whose `replicas` cost
    nothing but their decode step (`step_s`: every open call gets a token a step) and have KV room
    for any number of calls of `tokens`. A value may be a `%(...)` placeholder formatted later."""
    return f"""
namespace: bench
default_deadline_ms: 600000
heartbeat_s: 1.0
gateway: {{max_connections_per_client: 0}}
tiers:
  {tier}:
    warm_floor: {replicas}
    max_replicas: {replicas}
    slots: {slots}
    wait_limit_s: {{committed: 600, interactive: 600, speculative: 600, background: 600}}
    lease_s: 30
    sim:
      weights_gb: 0
      load_gb_s: 1
      warmup_s: 0
      prefill_tokens_per_s: 1.0e12
      decode_step: {{base_s: {step_s}, per_seq_s: 0}}
      kv_capacity_tokens: 1000000000
      typical_prompt_tokens: 8
      typical_output_tokens: {tokens}
"""


def bench_config(*tiers: str) -> str:
    """A fleet config (namespace `bench`, heartbeat 1 s) with these tiers' YAML under `tiers:`."""
    return "\nnamespace: bench\nheartbeat_s: 1.0\ntiers:\n" + "".join(tiers)

def fleet_env(config: str, redis_url: str) -> dict[str, str]:
    """Write `config` to a fresh fleet.yaml; the environment that points the parts at it and at Redis."""
    cfg = Path(tempfile.mkdtemp()) / "fleet.yaml"
    cfg.write_text(config)
    return {**os.environ, "REDIS_URL": redis_url, "FLEET_CONFIG": str(cfg)}


def fleetctl(*argv: str, env: dict[str, str], **kw: Any) -> subprocess.Popen[bytes]:
    """Start one part (`fleetctl gateway ...`, `fleetctl worker ...`) from the repository root."""
    return subprocess.Popen([sys.executable, "-m", "fleetctl", *argv], env=env, cwd=ROOT, **kw)


def stop(procs: Iterable[subprocess.Popen[bytes]], sig: int = signal.SIGTERM, wait_s: float = 20) -> None:
    """Signal every process first (so they stop together), then wait for each; kill one that outlives `wait_s`."""
    procs = list(procs)
    for p in procs:
        p.send_signal(sig)
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` (nearest rank); NaN when there is none."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def raise_fd_limit() -> int:
    """Each open call is a socket in this process and in the gateway: raise the soft limit to the hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
