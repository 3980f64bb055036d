"""The status table (`fleetctl.status_table.render`) of a busy fleet, with no fleet: whole at 80
columns, a long tier name leaving out the last column rather than cutting one, `--wide` giving
the rest. `fleet status` against a running fleet: tests/processes/test_status_cli.py."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from fleetctl.status_table import SPEND, TIERS, render


def _whole(text: str, width: int, words: list[str]) -> None:
    """Nothing cut (no ellipsis, no line past `width`) and every word there, whole."""
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width, text
    missing = [w for w in words if w not in text.split()]
    assert not missing, f"{missing} not whole in:\n{text}"


def _headers(columns: Any, wide: bool) -> list[str]:
    return [w for c in columns if wide or not c.wide_only for w in c.header.split()]


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
        "budget": {"exhausted": False, "capped": True, "window": "market-open"},
        "degraded": {"out": 0, "in": 0, "to": None}}
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


def test_degraded_calls_show_under_the_table_and_in_the_wide_column() -> None:
    """A tier that sent calls to a smaller one says how many and where; the one that took them says
    so; a tier that did neither says nothing (docs/degrade.md)."""
    doc = {"tiers": {"planner": _tier(degraded={"out": 17, "in": 0, "to": "analysis"}),
                     "analysis": _tier(degraded={"out": 0, "in": 17, "to": "routing"}),
                     "routing": _tier()}}
    out = io.StringIO()
    render(doc, Console(file=out, width=80))
    text = out.getvalue()
    assert "planner: degraded 17 out to analysis, 0 in" in text
    assert "analysis: degraded 0 out, 17 in" in text
    assert "routing: degraded" not in text
    _whole(text, 80, [])

    out = io.StringIO()
    render(doc, Console(file=out, width=80), wide=True)
    assert "degraded out/in" in out.getvalue() and "17/0" in out.getvalue().split()
