"""`fleet status`: the status document as a terminal table, or raw JSON; whole at 80 columns."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import httpx
from rich.console import Console

from fleet.redis_server import free_port
from fleetctl.status_table import SPEND, TIERS, render
from tests.harness import ROOT, Fleet


def _status(f: Fleet, *args: str, url: str | None = None, columns: int = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetctl", "status", "--url", url or f.base_url, *args],
                          env={**f.env, "COLUMNS": str(columns)}, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def _whole(text: str, width: int, words: list[str]) -> None:
    """Nothing cut (no ellipsis, no line past `width`) and every word there, whole."""
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width, text
    missing = [w for w in words if w not in text.split()]
    assert not missing, f"{missing} not whole in:\n{text}"


def _headers(columns: Any, wide: bool) -> list[str]:
    return [w for c in columns if wide or not c.wide_only for w in c.header.split()]


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


def _tier(**over: Any) -> dict[str, Any]:
    """A busy tier's status: a long line, a rollout under way, a scaler's reason, a budget."""
    s: dict[str, Any] = {
        "model": {"live": "v2", "rollout": {"kind": "canary", "from": "v1", "state": "rolling"}},
        "versions": {"v1": {"ready": 3}, "v2": {"ready": 1}},
        "line": {"committed": 12, "interactive": 340, "speculative": 5, "background": 1200},
        "in_flight": 1280, "seconds_to_drain": 123.456, "oldest_wait_s": 845.5, "arrival_rate": 1234.56,
        "service_rate": 987.65, "replicas": {"starting": 2, "ready": 10, "draining": 1}, "floor": 2,
        "ceiling": 16, "prewarm": {"floor": 40, "source": "schedule"},
        "last_decision": {"reason": "scale up 2 -> 4: the line drains in 123 s, above the 30 s threshold"},
        "spend_usd": 12345.678, "projected_spend_usd": 23456.78, "budget_usd": 50000.0, "budget_ceiling": 120,
        "replica_hours": {"total": 1234.567}, "cost_per_million_useful_tokens_usd": 12.3456,
        "budget": {"exhausted": False, "capped": True, "window": "market-open"}}
    return {**s, **over}


def test_a_busy_fleet_fits_80_columns_and_a_long_tier_name_leaves_out_the_last_column() -> None:
    doc = {"tiers": {"routing": _tier(), "analysis": _tier(seconds_to_drain=None),
                     "planner": _tier(budget_usd=None, budget_ceiling=None)}}
    out = io.StringIO()
    render(doc, Console(file=out, width=80))
    words = ["routing", "analysis", "capped", "(market-open)", "12/340/5/1200", "2/10/1", "123.46", "∞",
             *_headers(TIERS, wide=False), *_headers(SPEND, wide=False)]
    _whole(out.getvalue(), 80, words)
    assert "analysis: model v2 (canary from v1, rolling) v1:3 v2:1" in out.getvalue()  # on a line of its own
    assert "routing: scale up 2 -> 4" in out.getvalue()

    doc = {"tiers": {"interactive-routing": _tier(), "deep-analysis": _tier()}}
    out = io.StringIO()
    render(doc, Console(file=out, width=80))
    narrow = _headers(TIERS, wide=False)
    _whole(out.getvalue(), 80, ["interactive-routing", "deep-analysis", "12/340/5/1200", *narrow[:-1]])
    assert narrow[-1] == "ceiling" and "ceiling" not in out.getvalue().split()  # left out, not cut

    out = io.StringIO()
    render(doc, Console(file=out, width=80), wide=True)
    _whole(out.getvalue(), 10_000, ["12.3456", "1234.567", *_headers(TIERS, wide=True), *_headers(SPEND, wide=True)])
    assert "line c/i/s/b" in out.getvalue()  # a header on one line
