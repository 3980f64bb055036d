"""A short headless Locust run of the agent users and the market-open shape against a running fleet."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from tests.harness import ROOT, Fleet

TIERS = ("routing", "analysis", "planner")


def test_locust_agents_against_the_fleet(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_gateway().start_tiers(TIERS)
    prefix = tmp_path / "run"
    env = {**os.environ, "LOADTEST_DURATION_S": "20", "LOADTEST_PEAK_USERS": "6", "LOADTEST_CHAIN_DEADLINE_S": "15",
           "LOADTEST_TOKENS": "0.5"}
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py,loadtests/market_open.py", "--headless",
         "--host", fleet.base_url, "--csv", str(prefix), "--html", str(tmp_path / "report.html"), "--only-summary",
         "--loglevel", "WARNING"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]  # Locust exits 1 when any request failed
    assert "429s by reason" in out

    rows = list(csv.DictReader((prefix.with_name("run_stats.csv")).open()))
    by = {(r["Type"], r["Name"]): r for r in rows}
    assert int(by[("METRIC", "ttft")]["Request Count"]) > 0
    assert int(by[("METRIC", "tpot")]["Request Count"]) > 0
    assert 0 < float(by[("METRIC", "ttft")]["Median Response Time"]) < 10_000
    served = {r["Name"].split()[0] for r in rows if r["Type"] == "SSE" and int(r["Request Count"]) > 0}
    assert served == set(TIERS), served  # the chains reached every tier
    assert any(r["Type"] == "CHAIN" for r in rows)
    assert sum(int(r["Failure Count"]) for r in rows if r["Name"] != "Aggregated") == 0, \
        [r for r in rows if int(r["Failure Count"])]
    assert (tmp_path / "report.html").stat().st_size > 10_000
    # Every call the users made is accounted for by the fleet too.
    accepted = sum(fleet.counters(t).get("accepted", 0) for t in TIERS)
    assert accepted >= sum(int(r["Request Count"]) for r in rows if r["Type"] in ("SSE", "EXPIRED"))
