"""Trace arrivals: replay recorded production traffic (CSV or JSONL) in a scenario.

An arrival entry with `trace:` instead of `rate:` takes its arrival instants and
token counts from a file, e.g. the Azure LLM inference traces 2023 shipped in
`configs/traces/`:

    arrivals:
      - tier: analysis
        class: {interactive: 0.7, background: 0.3}   # or one class name
        trace: {file: configs/traces/azure-llm-2023-conv.csv, time: TIMESTAMP, time_unit: auto,
                prompt_tokens: ContextTokens, output_tokens: GeneratedTokens,
                speed: 1.0, copies: 1, jitter_s: 30, start_at: "08:00", max_output_tokens: 2048,
                prompt_scale: 1.0, output_scale: 1.0, max_prompt_tokens: 32768}

- `time`: the column with each call's arrival: date-time strings (ISO, as the
  Azure traces write them) or numbers; `time_unit` `s` or `ms` for numbers,
  `auto` reads strings as date-times and numbers as epoch milliseconds when
  they are at least 1e11 (a date after 1973 in ms), else seconds.
- The first row arrives at `start_at` (a local time of the scenario's day;
  default its start); `speed` 2 replays the file twice as fast.
- `copies` N overlays N copies, each after the first shifted by its own seeded
  offset in [0, `jitter_s`): more load with the trace's own shape.
- `prompt_scale` / `output_scale` multiply every row's token counts (rounded,
  at least 1): the trace's own arrivals and its own spread of lengths, re-sampled
  to longer (or shorter) calls, e.g. the conversation trace x10 as a long-context
  service. `max_prompt_tokens` caps a scaled prompt (what a replica's KV cache
  holds), `max_output_tokens` caps a row's output (a tier's max_tokens limit);
  both apply after the scaling.
- A relative `file` is found in the repo first, then beside the scenario.

Rows past the scenario's end are dropped; a bad row names its line number.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime, time
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleet.config import CLASSES, DEFAULT_CONFIG

REPO = DEFAULT_CONFIG.parent.parent
EPOCH_MS_FROM = 1e11  # auto: a number this large is epoch milliseconds


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, line and column."""


class TraceSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str
    time: str = "TIMESTAMP"
    time_unit: Literal["auto", "s", "ms"] = "auto"
    prompt_tokens: str = "ContextTokens"
    output_tokens: str = "GeneratedTokens"
    speed: float = Field(1.0, gt=0)
    copies: int = Field(1, ge=1, le=64)
    jitter_s: float = Field(30.0, ge=0)
    start_at: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    prompt_scale: float = Field(1.0, gt=0, le=1000)
    output_scale: float = Field(1.0, gt=0, le=1000)
    max_prompt_tokens: int | None = Field(None, ge=1)


class TraceArrival(BaseModel):
    """Calls to one tier replayed from a trace file, in one class or split by fractions."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    tier: str
    cls: str | dict[str, float] = Field(alias="class")
    trace: TraceSource
    deadline_ms: float | None = Field(None, gt=0)

    @field_validator("cls")
    @classmethod
    def _classes(cls, v: str | dict[str, float]) -> str | dict[str, float]:
        names = [v] if isinstance(v, str) else list(v)
        for n in names:
            if n not in CLASSES:
                raise ValueError(f"unknown priority class {n!r}; classes are {', '.join(CLASSES)}")
        if isinstance(v, dict) and (any(f < 0 for f in v.values()) or sum(v.values()) <= 0):
            raise ValueError("class fractions must be >= 0 and add up to more than 0")
        return v

    def fractions(self) -> list[tuple[str, float]]:
        """(class, cumulative share) for drawing each row's class."""
        if isinstance(self.cls, str):
            return [(self.cls, 1.0)]
        total = sum(self.cls.values())
        out, acc = [], 0.0
        for name, f in self.cls.items():
            acc += f / total
            out.append((name, acc))
        return out


@dataclass(frozen=True, slots=True)
class TraceRow:
    t: float  # seconds after the file's first row
    prompt: int
    output: int


def resolve(file: str, scenario_dir: Path | None) -> Path:
    """The repo first, then the scenario's folder, then as given (an absolute path)."""
    p = Path(file)
    cand = [p] if p.is_absolute() else [REPO / p, *([scenario_dir / p] if scenario_dir else []), p]
    for c in cand:
        if c.is_file():
            return c
    raise TraceError(f"trace.file: file not found: {file}")


def _records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    text = path.read_text()
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{path.name}:{i}: not JSON: {e}") from None
                if not isinstance(rec, dict):
                    raise TraceError(f"{path.name}:{i}: each line must be a JSON object")
                out.append((i, rec))
        return out
    return [(i, row) for i, row in enumerate(csv.DictReader(text.splitlines()), 2)]


def _time(v: Any, unit: str) -> float:
    if isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            if unit != "auto":
                raise
            return datetime.fromisoformat(v.strip()).timestamp()
    else:
        x = float(v)
    if unit == "ms" or (unit == "auto" and abs(x) >= EPOCH_MS_FROM):
        return x / 1000.0
    return x


@lru_cache(maxsize=16)
def _read(path: str, mtime: float, time_col: str, unit: str, prompt_col: str, output_col: str) -> tuple[TraceRow, ...]:
    p = Path(path)
    rows: list[tuple[float, int, int]] = []
    for line, rec in _records(p):
        try:
            t = _time(rec[time_col], unit)
            prompt, output = int(float(rec[prompt_col])), int(float(rec[output_col]))
        except KeyError as e:
            raise TraceError(f"{p.name}:{line}: no column {e.args[0]!r} (columns: {', '.join(rec)})") from None
        except (TypeError, ValueError) as e:
            raise TraceError(f"{p.name}:{line}: bad value: {e}") from None
        if not math.isfinite(t):
            raise TraceError(f"{p.name}:{line}: time is not finite")
        rows.append((t, max(1, prompt), max(1, output)))
    if not rows:
        raise TraceError(f"{p.name}: no rows")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return tuple(TraceRow(t - t0, pr, out) for t, pr, out in rows)


def read_trace(src: TraceSource, scenario_dir: Path | None) -> tuple[TraceRow, ...]:
    """The file's rows, times relative to its first row (read once per file and columns)."""
    p = resolve(src.file, scenario_dir)
    return _read(str(p), p.stat().st_mtime, src.time, src.time_unit, src.prompt_tokens, src.output_tokens)


def check_trace(a: TraceArrival, scenario_dir: Path | None) -> str | None:
    """What is wrong with a trace arrival's file or start, naming the field; None: nothing."""
    try:
        read_trace(a.trace, scenario_dir)
        if a.trace.start_at is not None:
            time.fromisoformat(a.trace.start_at)
    except TraceError as e:
        return str(e) if str(e).startswith("trace.") else f"trace: {e}"
    except ValueError:
        return f"trace.start_at: not a time of day: {a.trace.start_at!r}"
    return None


def replay(src: TraceSource, rows: tuple[TraceRow, ...], offset_s: float, end_s: float,
           rng: random.Random) -> list[tuple[float, int, int]]:
    """(seconds into the scenario, prompt, output) for every copy's rows inside [0, end_s)."""
    out = []
    ps, os_ = src.prompt_scale, src.output_scale
    pcap, ocap = src.max_prompt_tokens, src.max_output_tokens
    for c in range(src.copies):
        shift = offset_s + (rng.uniform(0.0, src.jitter_s) if c else 0.0)
        for r in rows:
            t = shift + r.t / src.speed
            if t >= end_s:
                break
            if t >= 0:
                prompt = max(1, round(r.prompt * ps))
                output = max(1, round(r.output * os_))
                out.append((t, prompt if pcap is None else min(pcap, prompt),
                            output if ocap is None else min(ocap, output)))
    out.sort(key=lambda x: x[0])
    return out


def rate_points(times: list[float], end_s: float, bucket_s: float = 60.0) -> list[tuple[float, float]]:
    """A trace's arrivals as a rate curve (calls per second per `bucket_s`), for what plans
    from rates (the static baseline's peak)."""
    n = max(1, math.ceil(end_s / bucket_s))
    counts = [0] * n
    for t in times:
        if 0 <= t < end_s:
            counts[min(n - 1, int(t // bucket_s))] += 1
    pts: list[tuple[float, float]] = []
    for i, c in enumerate(counts):
        pts += [(i * bucket_s, c / bucket_s), ((i + 1) * bucket_s - 1e-6, c / bucket_s)]
    return pts
