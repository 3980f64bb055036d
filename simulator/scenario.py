"""The scenario file: what a burst looks like, in YAML, replayable by `fleet simulate`.

A scenario names the fleet config to use (a file, overrides on top of it, or a
whole fleet inline), when the replay starts (date and time of day, because
pre-warm windows and budget windows are cron schedules), how long it runs, the
arrival processes per tier and class (rates that change over time, bursts,
Poisson or deterministic, prompt and output length distributions, deadlines),
and agent chains (a planner call fanning out to analysis calls, each making
routing calls, under one deadline for the whole chain).

Shape:

    start: "2026-11-30T08:00:00"     # a Monday; local time in `timezone`
    timezone: America/New_York
    duration: "2h15m"                # or seconds
    tick_s: 1.0                      # the scaler's tick, as live
    seed: 7
    fleet_config: configs/fleet.yaml # optional base; relative to the repo, then the scenario
    fleet: {tiers: {planner: {warm_floor: 1}}}   # deep-merged over the base
    deadlines_ms: {committed: 30000, speculative: 20000}   # defaults per class
    arrivals:
      - tier: routing
        class: interactive
        process: poisson             # or deterministic
        rate: [["08:00", 2], ["08:30", 60], ["09:10", 5]]   # req/s, linear between points
        bursts: [{at: "08:30", for: "10m", add: 40}]
        prompt_tokens: {dist: lognormal, mean: 400, sd: 120, min: 16, max: 4000}
        output_tokens: 60
        deadline_ms: 8000
    chains:
      - name: thesis
        class: committed
        rate: [["08:00", 0.02], ["08:33", 1.5]]
        deadline_ms: 90000
        stages:
          - {tier: planner, fanout: 1, prompt_tokens: 1500, output_tokens: 300}
          - {tier: analysis, fanout: 4, prompt_tokens: 600, output_tokens: 120}
          - {tier: routing, fanout: 3, prompt_tokens: 200, output_tokens: 20}

Times inside the day ("08:30", "08:30:15") are local times on the start date; durations are
seconds or "90s", "10m", "1h30m". A `client:` (`simulator.client_spec`) gives callers an SDK.
"""

from __future__ import annotations

import copy
import itertools
import random
import tempfile
from datetime import datetime, time, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator
from pydantic.functional_validators import AfterValidator

from fleet.config import (
    CLASSES,
    DEFAULT_CONFIG,
    ConfigError,
    FleetConfig,
    load_config,
    per_class_positive,
    valid_timezone,
)
from fleet.durations import duration_s
from simulator.client_spec import ClientSpec
from simulator.tracefile import TraceArrival, check_trace, rate_points, read_trace, replay

REPO = DEFAULT_CONFIG.parent.parent


class ScenarioError(Exception):
    """A scenario that cannot be replayed; the message names the bad field."""


def parse_duration(v: Any) -> float:
    """Seconds from a number or "1h30m", "10m", "90s" (the CLI's format)."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        return duration_s(v)
    raise ValueError(f"not a duration: {v!r} (use seconds or e.g. '90s', '10m', '1h30m')")


def _known_class(v: str) -> str:
    if v not in CLASSES:
        raise ValueError(f"unknown priority class {v!r}; classes are {', '.join(CLASSES)}")
    return v


ClassName = Annotated[str, AfterValidator(_known_class)]  # a priority class, named in its error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Length(_Strict):
    """A token-count distribution. A plain integer in YAML means fixed."""

    dist: Literal["fixed", "uniform", "normal", "lognormal"] = "fixed"
    mean: float = Field(gt=0)
    sd: float = Field(0.0, ge=0)
    min: int = Field(1, ge=1)
    max: int = Field(100_000, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _from_int(cls, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            return {"dist": "fixed", "mean": v}
        return v

    @model_validator(mode="after")
    def _bounds(self) -> Length:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) exceeds max ({self.max})")
        return self


class Burst(_Strict):
    """Extra arrivals on top of the rate curve: `add` req/s for `for_s` from `at`."""

    at: str
    for_s: float = Field(alias="for")
    add: float = Field(ge=0)

    @field_validator("for_s", mode="before")
    @classmethod
    def _dur(cls, v: Any) -> float:
        return parse_duration(v)


RatePoints = list[tuple[str | float, float]]


class _Process(_Strict):
    process: Literal["poisson", "deterministic"] = "poisson"
    rate: RatePoints | float
    bursts: list[Burst] = Field(default_factory=list)

    @field_validator("rate")
    @classmethod
    def _rates(cls, v: RatePoints | float) -> RatePoints | float:
        pts = [("00:00", v)] if isinstance(v, int | float) else v
        for _, r in pts:
            if r < 0:
                raise ValueError("rates must be >= 0")
        return v


class Arrival(_Process):
    """Independent calls to one tier in one class."""

    tier: str
    cls: ClassName = Field(alias="class")
    prompt_tokens: Length = Field(default_factory=lambda: Length(mean=200))
    output_tokens: Length = Field(default_factory=lambda: Length(mean=100))
    deadline_ms: float | None = Field(None, gt=0)
    key: str | None = Field(None, min_length=1, max_length=128)  # the API key it calls with: its flow
    client: ClientSpec | None = None  # its callers' SDK (`simulator.client_spec`); None: the scenario's


class Stage(_Strict):
    """One level of an agent chain: `fanout` calls to `tier` per call of the level above."""

    tier: str
    fanout: int = Field(1, ge=1, le=64)
    prompt_tokens: Length = Field(default_factory=lambda: Length(mean=200))
    output_tokens: Length = Field(default_factory=lambda: Length(mean=100))


class Chain(_Process):
    """An agent chain: a planner call, then its fan-out, with one deadline for it all."""

    name: str
    cls: ClassName = Field("committed", alias="class")
    deadline_ms: float = Field(gt=0)
    stages: list[Stage] = Field(min_length=1)
    conversation: bool = False  # its stages are the turns of one growing conversation: one prefix, cached
    client: ClientSpec | None = None  # its agent's SDK (`simulator.client_spec`); None: the scenario's


def _arrival_kind(v: Any) -> str:
    """An arrival entry with `trace:` replays a file; any other follows a rate curve."""
    has = ("trace" in v) if isinstance(v, dict) else isinstance(v, TraceArrival)
    return "TraceArrival" if has else "Arrival"


class ScenarioFile(_Strict):
    name: str = ""
    description: str = ""
    start: datetime
    timezone: str = "UTC"
    duration_s: float = Field(alias="duration")
    tick_s: float = Field(1.0, gt=0, le=60)
    seed: int = 0
    fleet_config: str | None = None
    fleet: dict[str, Any] = Field(default_factory=dict)
    deadlines_ms: dict[str, float] = Field(default_factory=dict)
    arrivals: list[Annotated[Annotated[Arrival, Tag("Arrival")] | Annotated[TraceArrival, Tag("TraceArrival")],
                             Discriminator(_arrival_kind)]] = Field(default_factory=list)
    chains: list[Chain] = Field(default_factory=list)
    client: ClientSpec | None = None  # every stream's SDK unless it names its own; None: no client model
    # Checks a run can be held to: named expectations the report prints as pass/fail.
    expect: dict[str, Any] = Field(default_factory=dict)

    @field_validator("duration_s", mode="before")
    @classmethod
    def _dur(cls, v: Any) -> float:
        d = parse_duration(v)
        if d <= 0:
            raise ValueError("duration must be > 0")
        return d

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        return valid_timezone(v)

    @field_validator("deadlines_ms")
    @classmethod
    def _classes(cls, v: dict[str, float]) -> dict[str, float]:
        return per_class_positive(v, "deadline")


class Scenario:
    """A validated scenario with its fleet config and its clock resolved."""

    def __init__(self, spec: ScenarioFile, cfg: FleetConfig, path: Path | None = None) -> None:
        self.spec = spec
        self.cfg = cfg
        self.path = path
        self.tz = ZoneInfo(spec.timezone)
        start = spec.start if spec.start.tzinfo else spec.start.replace(tzinfo=self.tz)
        self.start = start
        self.start_epoch = start.timestamp()
        self.duration_s = spec.duration_s
        self.dir = path.parent if path else None
        for i, a in enumerate(spec.arrivals):
            self._known_tier(a.tier, f"arrivals.{i}.tier")
            bad = check_trace(a, self.dir) if isinstance(a, TraceArrival) else None
            if bad:
                raise ScenarioError(f"arrivals.{i}.{bad}")
        for i, c in enumerate(spec.chains):
            for j, st in enumerate(c.stages):
                self._known_tier(st.tier, f"chains.{i}.stages.{j}.tier")

    def _known_tier(self, tier: str, where: str) -> None:
        if self.cfg.resolve_model(tier) is None:
            raise ScenarioError(f"{where}: unknown tier {tier!r}; tiers are {', '.join(self.cfg.tiers)}")

    @property
    def name(self) -> str:
        return self.spec.name or (self.path.stem if self.path else "scenario")

    def at(self, clock: str) -> float:
        """Seconds from the start of the replay to a local time of day ("08:30") on the start date.

        A time before the start is on the following day only if the scenario
        runs past midnight; otherwise it is simply before the start (negative).
        """
        t = time.fromisoformat(clock)
        when = datetime.combine(self.start.date(), t, tzinfo=self.tz)
        off = when.timestamp() - self.start_epoch
        if off < 0 and off + 86400 <= self.duration_s:
            off += 86400
        return off

    def clock(self, t: float) -> str:
        """The local time of day at `t` seconds into the replay."""
        return (self.start + timedelta(seconds=t)).astimezone(self.tz).strftime("%H:%M:%S")

    def epoch(self, t: float) -> float:
        return self.start_epoch + t

    def datetime(self, t: float) -> datetime:
        return datetime.fromtimestamp(self.start_epoch + t, tz=self.tz)

    def deadline_ms(self, cls: str, given: float | None) -> float:
        if given is not None:
            return given
        return self.spec.deadlines_ms.get(cls, float(self.cfg.default_deadline_ms))

    def trace_calls(self, a: TraceArrival, rng: random.Random) -> list[tuple[float, int, int]]:
        """A trace arrival's calls: (seconds into the replay, prompt, output), its copies drawn from `rng`."""
        offset = self.at(a.trace.start_at) if a.trace.start_at else 0.0
        return replay(a.trace, read_trace(a.trace, self.dir), offset, self.duration_s, rng)

    def rate_points(self, p: _Process | TraceArrival) -> list[tuple[float, float]]:
        """The rate curve as (seconds, req/s) points, bursts folded in as steps (a trace: per minute)."""
        if isinstance(p, TraceArrival):
            calls = self.trace_calls(p, random.Random(f"{self.spec.seed}/rate"))
            return rate_points([t for t, _, _ in calls], self.duration_s)
        raw = [("00:00", float(p.rate))] if isinstance(p.rate, int | float) else p.rate
        pts = sorted((self.at(c) if isinstance(c, str) else float(c), float(r)) for c, r in raw)
        if isinstance(p.rate, int | float):
            pts = [(0.0, float(p.rate)), (self.duration_s, float(p.rate))]
        for b in p.bursts:
            a = self.at(b.at)
            pts = _add_step(pts, a, a + b.for_s, b.add)
        return pts


def rate_at(pts: list[tuple[float, float]], t: float) -> float:
    """The rate at `t` of a curve given as (seconds, req/s) points, linear between them."""
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, r0), (t1, r1) in itertools.pairwise(pts):
        if t0 <= t < t1:
            return r0 if t1 == t0 else r0 + (r1 - r0) * (t - t0) / (t1 - t0)
    return pts[-1][1]


def _add_step(pts: list[tuple[float, float]], a: float, b: float, add: float) -> list[tuple[float, float]]:
    eps = 1e-6
    knots = sorted({t for t, _ in pts} | {a - eps, a, b - eps, b})
    out = []
    for t in knots:
        r = rate_at(pts, t)
        if a <= t < b:
            r += add
        out.append((t, r))
    return out


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


_TAGS = ("Arrival", "TraceArrival")  # the arrival kind: not part of the field's name


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"] if p not in _TAGS) or "(top level)"
        lines.append(f"  {path}: {err['msg']}")
    return "\n".join(lines)


def _resolve(p: str, scenario_dir: Path | None) -> Path:
    cand = [Path(p)] if Path(p).is_absolute() else [REPO / p, *([scenario_dir / p] if scenario_dir else []), Path(p)]
    for c in cand:
        if c.is_file():
            return c
    raise ScenarioError(f"fleet_config: file not found: {p}")


def build_fleet(spec: ScenarioFile, scenario_dir: Path | None) -> FleetConfig:
    """The fleet config the scenario runs: base file (if any) with the scenario's overrides on top.

    It goes through `load_config`, so it is checked exactly as a live config is,
    and a bad override names its field.
    """
    base: dict[str, Any] = {}
    if spec.fleet_config:
        base = yaml.safe_load(_resolve(spec.fleet_config, scenario_dir).read_text()) or {}
    merged = _deep_merge(base, spec.fleet)
    if not merged.get("tiers"):
        raise ScenarioError("fleet: no tiers (name a fleet_config, or give fleet.tiers)")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "fleet.yaml"
        f.write_text(yaml.safe_dump(merged, sort_keys=False))
        try:
            return load_config(f)
        except ConfigError as e:
            raise ScenarioError(str(e).replace(str(f), "scenario fleet config")) from None


def parse_scenario(raw: Any, path: Path | None = None) -> Scenario:
    if not isinstance(raw, dict):
        raise ScenarioError("a scenario must be a YAML mapping")
    try:
        spec = ScenarioFile.model_validate(raw)
    except ValidationError as e:
        raise ScenarioError(f"{path or 'scenario'}: invalid scenario:\n{_describe(e)}") from None
    return Scenario(spec, build_fleet(spec, path.parent if path else None), path)


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"scenario file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ScenarioError(f"{p}: not valid YAML: {e}") from None
    return parse_scenario(raw, p)
