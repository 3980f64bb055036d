"""`fleet status`: the status document as a terminal table, or raw JSON; whole at 80 columns (the
table of a busy fleet, rendered with no fleet: tests/pure/test_status_table.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from fleet.redis_server import free_port
from fleetctl.status_table import TIERS
from tests.harness import ROOT, Fleet
from tests.pure.test_status_table import _headers, _whole


def _status(f: Fleet, *args: str, url: str | None = None, columns: int = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetctl", "status", "--url", url or f.base_url, *args],
                          env={**f.env, "COLUMNS": str(columns)}, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_status_table_and_json_show_every_tier_and_what_happened(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker("routing")
    for _ in range(3):
        r = httpx.post(f"{fleet.base_url}/v1/chat/completions", timeout=30,
                       json={"model": "routing", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert r.status_code == 200
    table = _status(fleet)
    assert table.returncode == 0, table.stderr
    for tier in ("routing", "analysis", "planner"):
        assert tier in table.stdout
    row = next(line for line in table.stdout.splitlines() if "routing" in line)
    assert "0/1/0" in row  # replicas starting/ready/draining

    doc = json.loads(_status(fleet, "--json").stdout)
    assert doc["tiers"]["routing"]["outcomes"]["completed"] == 3
    assert doc["tiers"]["routing"]["replicas"]["ready"] == 1
    assert set(doc["tiers"]) == {"routing", "analysis", "planner"}


def test_status_says_when_the_gateway_is_unreachable(fleet: Fleet) -> None:
    r = _status(fleet, url=f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1
    assert "cannot reach the gateway" in r.stderr and "Traceback" not in r.stderr


def test_status_is_whole_at_80_columns_and_wide_gives_the_rest(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker("routing")
    narrow = _status(fleet, columns=80)
    assert narrow.returncode == 0, narrow.stderr
    _whole(narrow.stdout, 80, ["routing", "analysis", "planner", *_headers(TIERS, wide=False)])
    assert "0/1/0" in next(line for line in narrow.stdout.splitlines() if line.startswith("routing"))
    assert "arrive/s" not in narrow.stdout and "--wide" in narrow.stdout

    wide = _status(fleet, "--wide", columns=80)
    assert wide.returncode == 0, wide.stderr
    assert "…" not in wide.stdout
    head = next(line for line in wide.stdout.splitlines() if line.startswith("tier"))
    for header in (c.header for c in TIERS):  # one line of headers, each whole
        assert header in head, head
