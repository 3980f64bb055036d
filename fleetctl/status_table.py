"""The status document as terminal tables, whole at 80 columns.

Each table names its columns once, with a flag for those only `--wide` shows. The narrow
view keeps what a person reads first (the line, drain time, replicas, floor and ceiling;
spend against budget) in an 80-column terminal: light rules instead of boxes, a header
wrapped onto a second line rather than cut, the last columns left out rather than cut
where a tier's name is too long, and a rollout under way said on a line of its own under
the table. `--wide` adds the rest and draws the tables at their full width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, NamedTuple
from zoneinfo import ZoneInfo

from rich import box
from rich.console import Console
from rich.table import Table

Row = tuple[str, dict[str, Any]]  # a tier's name and its status
WORDS = {"tier", "model", "budget"}  # columns of words, read from the left; the others are figures


class Column(NamedTuple):
    header: str
    cell: Callable[[str, dict[str, Any]], str]
    wide_only: bool = False


def _num(v: Any, fmt: str = "{:.2f}") -> str:
    return "∞" if v is None else fmt.format(v)


def _replicas(s: dict[str, Any]) -> str:
    r = s["replicas"]
    return f"{r.get('starting', 0)}/{r.get('ready', 0)}/{r.get('draining', 0)}"


def _live(s: dict[str, Any]) -> str:
    return str((s.get("model") or {}).get("live", "-"))


def _model(s: dict[str, Any]) -> str:
    """The live version, a rollout under way, and the ready replicas of each version when they differ."""
    live = _live(s)
    ro = (s.get("model") or {}).get("rollout") or {}
    if ro and ro.get("state") != "done":
        live += f" ({ro.get('kind')} from {ro.get('from')}, {ro.get('state')})"
    ready = {v: c.get("ready", 0) for v, c in (s.get("versions") or {}).items() if c.get("ready", 0)}
    if len(ready) > 1:
        live += " " + " ".join(f"{v}:{n}" for v, n in sorted(ready.items()))
    return live


def _budget_state(s: dict[str, Any]) -> str:
    b = s.get("budget") or {}
    state = "EXHAUSTED" if b.get("exhausted") else ("capped" if b.get("capped") else "ok")
    return f"{state} ({b['window']})" if b.get("window") else state


def _if_budget(v: Any, fmt: str = "{:.2f}") -> Callable[[str, dict[str, Any]], str]:
    """A spend figure that means nothing without a budget: '-' for a tier that has none."""
    return lambda _, s: "-" if s["budget_usd"] is None else _num(s[v], fmt)


TIERS = (
    Column("tier", lambda t, _: t),
    Column("model", lambda _, s: _live(s)),
    Column("line c/i/s/b", lambda _, s: "/".join(str(v) for v in s["line"].values())),
    Column("in flight", lambda _, s: str(s["in_flight"])),
    Column("drain s", lambda _, s: _num(s["seconds_to_drain"])),
    Column("oldest s", lambda _, s: _num(s["oldest_wait_s"])),
    Column("arrive/s", lambda _, s: _num(s["arrival_rate"]), wide_only=True),
    Column("serve/s", lambda _, s: _num(s["service_rate"]), wide_only=True),
    Column("replicas s/r/d", lambda _, s: _replicas(s)),
    Column("floor", lambda _, s: str(s["floor"])),
    Column("ceiling", lambda _, s: str(s["ceiling"])),
    Column("degraded out/in", lambda _, s: _degraded(s), wide_only=True),
)
TIERS_CAPTION = "line: committed/interactive/speculative/background; replicas: starting/ready/draining"

SPEND = (  # today = the tier's budget day, as the budget governor last judged it
    Column("tier", lambda t, _: t),
    Column("spent today $", lambda _, s: _num(s["spend_usd"])),
    Column("projected $", _if_budget("projected_spend_usd")),
    Column("budget $", _if_budget("budget_usd")),
    Column("budget ceiling", lambda _, s: "-" if s["budget_ceiling"] is None else str(s["budget_ceiling"]),
           wide_only=True),
    Column("replica-h", lambda _, s: _num(s["replica_hours"]["total"], "{:.3f}"), wide_only=True),
    Column("$/M useful tok", lambda _, s: _num(s["cost_per_million_useful_tokens_usd"], "{:.4f}"), wide_only=True),
    Column("budget", lambda _, s: _budget_state(s)),
)


GAP = 2  # characters between two columns: the tables' padding, collapsed
UNBOUNDED = 10_000  # the room of `--wide`: every column at its natural width


def _widths(headers: list[str], cells: list[list[str]], room: int) -> list[int] | None:
    """Each column's width within `room`: its natural width (header and cells on one line) while
    the whole table fits, else, the most to gain first, down to its longest header word or cell
    (the header wraps at its spaces; a figure is never cut). None: not even that fits."""
    natural = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    least = [max([*(len(w) for w in h.split()), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    room -= GAP * (len(headers) - 1)
    if sum(least) > room:
        return None
    widths = natural[:]
    for i in sorted(range(len(headers)), key=lambda i: least[i] - natural[i]):
        widths[i] = max(least[i], widths[i] - max(0, sum(widths) - room))
    return widths


def _table(title: str, columns: Iterable[Column], rows: list[Row], room: int, wide: bool,
           caption: str | None = None) -> tuple[Table, int]:
    """The rows under the columns the view shows, within `room` characters (the last columns left
    out where even wrapped headers do not fit); the table and its width. Widths are set here,
    not by rich, which narrows the widest columns first, cutting a figure or a word."""
    shown = [c for c in columns if wide or not c.wide_only]
    cells = [[c.cell(tier, s) for c in shown] for tier, s in rows]
    widths = _widths([c.header for c in shown], cells, room)
    while widths is None and len(shown) > 2:  # fewer columns; the tier's name stays
        shown, cells = shown[:-1], [row[:-1] for row in cells]
        widths = _widths([c.header for c in shown], cells, room)
    if widths is None:  # narrower than a tier's name and one column: drawn as it is, for the terminal to wrap
        widths = _widths([c.header for c in shown], cells, UNBOUNDED) or []
    t = Table(title=title, header_style="bold", caption=caption, caption_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, pad_edge=False, collapse_padding=True)
    for c, width in zip(shown, widths, strict=True):
        t.add_column(c.header, justify="left" if c.header in WORDS else "right", width=width)
    for row in cells:
        t.add_row(*row)
    return t, sum(widths) + GAP * (len(widths) - 1)


def _clock(t: float, tz: str) -> str:
    return datetime.fromtimestamp(t, ZoneInfo(tz)).strftime("%a %H:%M:%S")


def _degraded(s: dict[str, Any]) -> str:
    d = s.get("degraded") or {}
    return f"{d.get('out', 0)}/{d.get('in', 0)}"


def degraded_line(tier: str, s: dict[str, Any]) -> str | None:
    """Calls this tier refused and a smaller tier served (out, and where they went), and those it
    served for a larger one (in): docs/degrade.md. None while it has done neither."""
    d = s.get("degraded") or {}
    out, took = d.get("out", 0), d.get("in", 0)
    if not (out or took):
        return None
    where = f" to {d['to']}" if out and d.get("to") else ""
    return f"{tier}: degraded {out} out{where}, {took} in"


def window_line(tier: str, w: dict[str, Any]) -> str:
    """One scheduled pre-warm window as the scaler plans it: when its replicas start, and why."""
    tz = w["timezone"]
    when = "raised now" if w["active"] else "next"
    if w["kind"] == "ready_at":
        head = f"floor {w['floor']} ready by {_clock(w['ready_by'], tz)}, replicas start {_clock(w['start'], tz)}"
    else:
        head = f"floor {w['floor']} from {_clock(w['ready_by'], tz)}, replicas start {_clock(w['start'], tz)}"
    return f"{tier}: pre-warm ({when}) {head}, until {_clock(w['end'], tz)} {tz}: {w['why']}"


def cold_start_line(tier: str, s: dict[str, Any]) -> str | None:
    """The live replicas' cold start by phase (medians) beside the model, and the model's error
    (docs/operations.md, "Cold starts by phase"). None while no replica has told its phases."""
    cs = s.get("cold_start") or {}
    m = cs.get("measured")
    if not cs.get("replicas") or not m:
        return None
    parts = f"load {m['load_s']:.2f}s, init {m['init_s']:.2f}s, first token {m['first_token_s']:.2f}s"
    if m.get("unaccounted_s", 0) >= 0.01:
        parts += f", other {m['unaccounted_s']:.2f}s"
    errs = {e["term"]: e for e in cs.get("error") or ()}
    mod = cs.get("modelled") or {}
    model = f"model {mod.get('total_s', 0):.2f}s"
    if mod.get("load_s") is not None:
        model += f" (load {mod['load_s']:.2f}s, warm-up {mod['warmup_s']:.2f}s)"
    worst = [f"{t} {e['error_s']:+.2f}s" for t, e in errs.items() if e.get("error_s") is not None]
    return (f"{tier}: cold start (median of {cs['replicas']}) {m['total_s']:.2f}s = {parts}; {model}; "
            f"error {', '.join(worst)}")


def render(doc: dict[str, Any], console: Console | None = None, *, wide: bool = False) -> None:
    """The status document as tables: each tier's line, drain and replicas; the scaler's last
    reason; spend against budget. Narrow (the default) fits the console; `wide` shows every
    column, the console widened to the table where it is narrower."""
    console = console or Console()
    tiers = list(doc["tiers"].items())
    spending = [(t, s) for t, s in tiers if s.get("spend_usd") is not None]  # a tier not judged yet is left out
    room = UNBOUNDED if wide else console.width
    made = [_table("Fleet Gateway", TIERS, tiers, room, wide, TIERS_CAPTION)]
    if spending:
        made.append(_table("Spend", SPEND, spending, room, wide))
    tables = [t for t, _ in made]
    if wide:
        console.width = max([console.width] + [width for _, width in made])
    console.print(tables[0])
    for tier, s in tiers:
        if _model(s) != _live(s):  # a rollout under way, or versions mixed: more than a column holds
            console.print(f"{tier}: model {_model(s)}", markup=False)
        if s.get("last_decision"):  # the scaler's why, when one is running
            pw = s.get("prewarm")
            extra = f"  [pre-warm floor {pw['floor']}, {pw['source']}]" if pw else ""
            console.print(f"{tier}: {s['last_decision']['reason']}{extra}", markup=False)
        for w in s.get("prewarm_windows") or ():  # each scheduled window's planned start, and why
            console.print(window_line(tier, w), markup=False)
        if (line := degraded_line(tier, s)) is not None:  # the narrow table has no room for it
            console.print(line, markup=False)
        if (line := cold_start_line(tier, s)) is not None:  # measured by phase, beside the model
            console.print(line, markup=False)
    for t in tables[1:]:
        console.print(t)
    if not wide:
        console.print("(fleet status --wide: every column)", style="dim")
