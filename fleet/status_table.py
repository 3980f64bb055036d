"""The status document as a terminal table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _num(v: Any, fmt: str = "{:.2f}") -> str:
    return "∞" if v is None else fmt.format(v)


def render(doc: dict[str, Any], console: Console | None = None) -> None:
    t = Table(title="Fleet Gateway", header_style="bold")
    for col in ("tier", "line c/i/s/b", "in flight", "drain s", "oldest s", "arrive/s", "serve/s",
                "replicas start/ready/drain", "floor", "ceiling"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for tier, s in doc["tiers"].items():
        line = "/".join(str(v) for v in s["line"].values())
        r = s["replicas"]
        t.add_row(tier, line, str(s["in_flight"]), _num(s["seconds_to_drain"]), _num(s["oldest_wait_s"]),
                  _num(s["arrival_rate"]), _num(s["service_rate"]),
                  f"{r.get('starting', 0)}/{r.get('ready', 0)}/{r.get('draining', 0)}",
                  str(s["floor"]), str(s["ceiling"]))
    (console or Console()).print(t)
