"""The status document as a terminal table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _num(v: Any, fmt: str = "{:.2f}") -> str:
    return "∞" if v is None else fmt.format(v)


def render(doc: dict[str, Any], console: Console | None = None) -> None:
    """The status document as tables: each tier's line, drain and replicas; the scaler's last
    reason; spend against budget."""
    t = Table(title="Fleet Gateway", header_style="bold")
    for col in ("tier", "model", "line c/i/s/b", "in flight", "drain s", "oldest s", "arrive/s", "serve/s",
                "replicas start/ready/drain", "floor", "ceiling"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for tier, s in doc["tiers"].items():
        line = "/".join(str(v) for v in s["line"].values())
        r = s["replicas"]
        t.add_row(tier, _model(s), line, str(s["in_flight"]), _num(s["seconds_to_drain"]), _num(s["oldest_wait_s"]),
                  _num(s["arrival_rate"]), _num(s["service_rate"]),
                  f"{r.get('starting', 0)}/{r.get('ready', 0)}/{r.get('draining', 0)}",
                  str(s["floor"]), str(s["ceiling"]))
    (console or Console()).print(t)
    for tier, s in doc["tiers"].items():  # the scaler's why, when one is running
        if s.get("last_decision"):
            pw = s.get("prewarm")
            extra = f"  [pre-warm floor {pw['floor']}, {pw['source']}]" if pw else ""
            (console or Console()).print(f"{tier}: {s['last_decision']['reason']}{extra}", markup=False)
    if any(s.get("spend_usd") is not None for s in doc["tiers"].values()):
        (console or Console()).print(_spend_table(doc))


def _model(s: dict[str, Any]) -> str:
    """The live version, a rollout under way, and the ready replicas of each version when they differ."""
    m = s.get("model") or {}
    live = str(m.get("live", "-"))
    ro = m.get("rollout") or {}
    if ro and ro.get("state") != "done":
        live += f" ({ro.get('kind')} from {ro.get('from')}, {ro.get('state')})"
    ready = {v: c.get("ready", 0) for v, c in (s.get("versions") or {}).items() if c.get("ready", 0)}
    if len(ready) > 1:
        live += " " + " ".join(f"{v}:{n}" for v, n in sorted(ready.items()))
    return live


def _spend_table(doc: dict[str, Any]) -> Table:
    """Spend against budget per tier (today = the tier's budget day), as the budget governor last
    judged it; a tier not judged yet is left out."""
    t = Table(title="Spend", header_style="bold")
    for col in ("tier", "spent today $", "projected $", "budget $", "budget ceiling", "replica-h", "$/M useful tok",
                "budget"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for tier, s in doc["tiers"].items():
        if s.get("spend_usd") is None:
            continue
        b = s.get("budget") or {}
        state = "EXHAUSTED" if b.get("exhausted") else ("capped" if b.get("capped") else "ok")
        none = s["budget_usd"] is None
        ceiling = "-" if s["budget_ceiling"] is None else str(s["budget_ceiling"])
        t.add_row(tier, _num(s["spend_usd"]), "-" if none else _num(s["projected_spend_usd"]),
                  "-" if none else _num(s["budget_usd"]), ceiling,
                  _num(s["replica_hours"]["total"], "{:.3f}"), _num(s["cost_per_million_useful_tokens_usd"], "{:.4f}"),
                  f"{state} ({b['window']})" if b.get("window") else state)
    return t
