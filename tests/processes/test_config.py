"""A bad config stops the command with a message naming the field, never a traceback (the config's
own checks, with no process: tests/pure/test_config.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.harness import ROOT, TEST_CONFIG


def test_cli_reports_bad_config_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text(TEST_CONFIG.read_text().replace("slots: 4\n", "slots: -1\n", 1))
    r = subprocess.run([sys.executable, "-m", "fleetctl", "worker", "--tier", "routing", "--config", str(bad)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2
    assert "tiers.routing.slots" in r.stderr
    assert "Traceback" not in r.stderr
