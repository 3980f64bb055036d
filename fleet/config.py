"""The fleet config: one YAML file, overridable by FLEET_... environment variables.

A bad config must stop start-up with a message that names the field, never a
traceback, so `load_config` turns pydantic's errors into a `ConfigError`
whose text lists each offending path.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from fleet.classes import CLASSES, Affinity, FairLine, Preemption, Priority, Replication, per_class_positive
from fleet.clock_config import ClientClock
from fleet.degrade_config import Degrade, KeyDegrade, degrade_checked
from fleet.engine_config import (  # noqa: F401  re-exported: callers import them from fleet.config
    CapacityProfile,
    DecodeStep,
    EngineName,
    OpenAIUpstream,
    SimProfile,
    VllmSettings,
    _Strict,
)
from fleet.model_config import ModelVersionConfig, RolloutConfig, merged, valid_version

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "fleet.yaml"


class ConfigError(Exception):
    """A config that cannot be used; the message names every bad field."""


def valid_timezone(v: str) -> str:
    """An IANA zone name, or a ValueError that says what is expected."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(v)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {v!r} (an IANA name such as America/New_York)") from None
    return v


class PrewarmWindow(_Strict):
    """A known burst: the floor is at least `floor` for `duration_s`, from each start of `cron`,
    or with the replicas ready by each `ready_at` (the scaler starts them the tier's p95 cold
    start and a tick before: `fleet.policy.prewarm`). Exactly one of the two."""

    cron: str | None = None
    ready_at: str | None = None
    floor: int = Field(ge=0)
    duration_s: float = Field(gt=0)

    @field_validator("cron", "ready_at")
    @classmethod
    def _valid_cron(cls, v: str | None) -> str | None:
        from croniter import croniter

        if v is not None and not croniter.is_valid(v):
            raise ValueError(f"not a valid cron expression: {v!r}")
        return v

    @model_validator(mode="after")
    def _one_time(self) -> PrewarmWindow:
        if self.cron is not None and self.ready_at is not None:
            raise ValueError("give either cron (when to start) or ready_at (when the replicas must be ready), "
                             "not both")
        if self.cron is None and self.ready_at is None:
            raise ValueError("a pre-warm window needs ready_at (when the replicas must be ready) or cron "
                             "(when to start)")
        return self

    @property
    def at(self) -> str:
        """The window's cron: its ready time (`ready_at`) or its start (`cron`)."""
        return self.ready_at if self.ready_at is not None else self.cron  # type: ignore[return-value]


class BudgetWindow(_Strict):
    """A named window with its own dollar ceiling (e.g. the open, 08:25-10:00)."""

    name: str
    cron: str
    duration_s: float = Field(gt=0)
    usd: float = Field(ge=0)

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, v: str) -> str:
        return PrewarmWindow._valid_cron(v)  # type: ignore[return-value]


class Budget(_Strict):
    daily_usd: float | None = Field(None, ge=0)
    reset_at: str = "00:00"  # HH:MM in `timezone`, when the daily budget starts over
    timezone: str = "UTC"
    windows: list[BudgetWindow] = Field(default_factory=list)

    @field_validator("reset_at")
    @classmethod
    def _valid_reset(cls, v: str) -> str:
        hh, sep, mm = v.strip().partition(":")
        if not (sep and hh.isdigit() and mm.isdigit() and int(hh) < 24 and int(mm) < 60):
            raise ValueError(f"reset_at must be HH:MM (24 h), got {v!r}")
        return v

    @field_validator("timezone")
    @classmethod
    def _valid_timezone(cls, v: str) -> str:
        return valid_timezone(v)

    @field_validator("windows")
    @classmethod
    def _unique_windows(cls, v: list[BudgetWindow]) -> list[BudgetWindow]:
        # Spend is looked up by window name: two windows of one name would share (and
        # misreport) their spend, and `daily` is the daily budget's own name.
        seen: set[str] = set()
        for w in v:
            if w.name == "daily":
                raise ValueError("window name 'daily' is reserved for the daily budget (daily_usd)")
            if w.name in seen:
                raise ValueError(f"window names must be unique: {w.name!r} appears twice")
            seen.add(w.name)
        return v


class ConfigWarning(UserWarning):
    """A config that loads but works against itself (e.g. limits that shed from the top)."""


def wait_limit_inversions(limits: dict[str, float]) -> list[str]:
    """Pairs of classes (both given a limit) where the higher class has the tighter wait limit: it would
    be refused while the lower one still joins. The limits shed from the bottom (committed: deadline only)."""
    given = [c for c in CLASSES if c in limits]
    return [f"{hi} ({limits[hi]:g} s) is tighter than {lo} ({limits[lo]:g} s)"
            for i, hi in enumerate(given) for lo in given[i + 1:] if limits[hi] < limits[lo]]


class TierConfig(_Strict):
    aliases: list[str] = Field(default_factory=list)
    engine: EngineName = EngineName.SIM
    warm_floor: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    drain_threshold_s: float = Field(2.0, gt=0)
    slots: int = Field(8, gt=0)
    max_tokens_limit: int = Field(4096, gt=0)
    # Longest a request of each class may be predicted to wait before it is shed.
    wait_limit_s: dict[str, float] = Field(
        default_factory=lambda: {"committed": 30.0, "interactive": 10.0, "speculative": 5.0, "background": 5.0}
    )
    scale_in_hold_s: float = Field(30.0, ge=0)
    lease_s: float = Field(10.0, gt=0)
    hourly_usd: float = Field(0.0, ge=0)
    usd_per_million_tokens: float | None = Field(None, ge=0)
    gpus_per_replica: int = Field(0, ge=0)
    gpu_memory_gb: float = Field(0.0, ge=0)
    budget: Budget = Field(default_factory=Budget)
    prewarm: list[PrewarmWindow] = Field(default_factory=list)
    capacity: CapacityProfile = Field(default_factory=CapacityProfile)
    sim: SimProfile = Field(default_factory=SimProfile)
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    openai: OpenAIUpstream = Field(default_factory=OpenAIUpstream)
    version: str = "v1"  # the version this tier's model is, in the model registry (fleet.model_config)
    versions: dict[str, ModelVersionConfig] = Field(default_factory=dict)  # more known versions
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    preemption: Preemption = Field(default_factory=Preemption)
    # Within a class: `fair` shares the line among flows by least attained service (docs/fair-line.md);
    # `fifo` keeps arrival order.
    fairness: Literal["fair", "fifo"] = "fair"
    affinity: Affinity = Field(default_factory=Affinity)  # claims prefer what a replica has cached
    degrade: Degrade | None = None  # where calls it cannot serve go instead (docs/degrade.md)

    @field_validator("wait_limit_s")
    @classmethod
    def _known_classes(cls, v: dict[str, float]) -> dict[str, float]:
        return per_class_positive(v, "wait limit")

    @model_validator(mode="after")
    def _floor_fits(self) -> TierConfig:
        if self.warm_floor > self.max_replicas:
            raise ValueError(f"warm_floor ({self.warm_floor}) exceeds max_replicas ({self.max_replicas})")
        for name, v in {self.version: None, **self.versions}.items():
            valid_version(name)
            if v is not None:  # each version's sim profile must be one, with the tier's underneath
                try:
                    SimProfile.model_validate(merged(self.sim.model_dump(), v.sim))
                except ValidationError as e:
                    raise ValueError(f"versions.{name}.sim: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None
        return self

    def wait_limit(self, priority: Priority) -> float:
        return self.wait_limit_s.get(priority.name, float("inf"))


class GatewayEdge(_Strict):
    """What a caller can make the gateway hold, and who may read fleet state (gateway/server.py, gateway/auth.py)."""

    max_header_bytes: int = Field(32_768, ge=1024, le=1_048_576)  # request line + every header, refused with 431
    header_timeout_s: float = Field(10.0, gt=0)  # a connection's request head must arrive within this
    body_timeout_s: float = Field(30.0, gt=0)  # then its body within this; else 408 and the connection closes
    max_connections_per_client: int = Field(1024, ge=0)  # open connections per client address; 0: no limit
    # Who may read /v1/fleet/status and /metrics: `auto` requires a key (admin or read_status)
    # as soon as any key exists, in the config or in Redis; `required` always; `open` never.
    status_auth: Literal["auto", "required", "open"] = "auto"
    max_prewarm_s: float = Field(6 * 3600, gt=0)  # the longest POST /v1/fleet/prewarm may raise a floor
    # With no API keys, a gateway listening beyond loopback serves completions only if this says so
    # (with a warning); admin endpoints never without an admin key (gateway/auth.py).
    open: bool = False


class ResponsesStore(_Strict):
    """What the Responses API keeps in Redis for `previous_response_id` (fleet/store/responses.py)."""

    ttl_s: int = Field(30 * 86_400, gt=0)  # how long a stored response lives (OpenAI's 30 days)
    # A turn's own items (its new input and its output) and the whole conversation a response keeps,
    # in JSON bytes; a turn past either is refused with a typed 400 before it runs.
    max_response_bytes: int = Field(1_048_576, gt=0)
    max_conversation_bytes: int = Field(4_194_304, gt=0)

    @model_validator(mode="after")
    def _conversation_holds_a_turn(self) -> ResponsesStore:
        if self.max_conversation_bytes < self.max_response_bytes:
            raise ValueError(f"max_conversation_bytes ({self.max_conversation_bytes}) is below max_response_bytes "
                             f"({self.max_response_bytes}): a conversation must hold at least one turn")
        return self


class ApiKey(_Strict):
    name: str = Field(min_length=1, max_length=128)
    sha256: str  # keys are stored hashed; see `fleet hash-key`. Also the key's id in Redis (its limits, budget)
    tiers: list[str] | None = Field(None, min_length=1)  # None: every tier (which exist: FleetConfig, `keys add`)
    default_priority: str = "interactive"
    max_priority: str = "committed"
    rpm: int | None = Field(None, gt=0)
    tpm: int | None = Field(None, gt=0)
    budget_usd: float | None = Field(None, ge=0)
    weight: float = Field(1.0, gt=0, le=1000)  # its flows' share of a busy class in a fair line
    degrade: KeyDegrade = "tier"  # its calls' default without X-Fleet-Degrade; `forbid`: never (docs/degrade.md)
    admin: bool = False
    read_status: bool = False  # may read /v1/fleet/status and /metrics (admin keys may too)

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        # A clear-text key pasted here by mistake must stop start-up, not silently never match.
        v = v.strip().lower()
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError("must be the 64-hex-digit sha256 of the key (`fleet hash-key SECRET`), not the key")
        return v

    @field_validator("default_priority", "max_priority")
    @classmethod
    def _a_class(cls, v: str) -> str:  # here, not only in the config: stored keys are read with this model
        if v not in CLASSES:
            raise ValueError(f"unknown priority class {v!r}; classes are {', '.join(CLASSES)}")
        return v

    @model_validator(mode="after")
    def _default_within_max(self) -> ApiKey:  # else every call without X-Priority is refused
        if CLASSES.index(self.default_priority) < CLASSES.index(self.max_priority):
            raise ValueError(f"default_priority {self.default_priority!r} is above max_priority {self.max_priority!r}")
        return self

    def unknown_tiers(self, tiers: Iterable[str]) -> list[str]:
        return [t for t in self.tiers or () if t not in set(tiers)]


class GpuInventory(_Strict):
    """GPUs to place on when NVML is absent (a laptop, CI)."""

    index: int = Field(ge=0)
    memory_gb: float = Field(gt=0)


_yaml_path: ContextVar[Path] = ContextVar("_yaml_path", default=DEFAULT_CONFIG)


class FleetConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEET_", env_nested_delimiter="__", extra="forbid")

    namespace: str = "fleet"
    default_priority: str = "interactive"
    default_deadline_ms: int = Field(120_000, gt=0)
    max_body_bytes: int = Field(1_048_576, gt=0)
    result_ttl_s: int = Field(300, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    rate_window_s: float = Field(10.0, gt=0)
    # A worker writes the streamed tokens of all its requests together, at most this
    # often: fewer Redis writes and SSE chunks for CPU the engine needs; 0 writes as
    # fast as Redis takes them. First tokens and last tokens never wait, and a replica
    # streaming to 16 callers or fewer waits for no window (workers/streaming.py).
    stream_window_ms: int = Field(20, ge=0, le=1000)
    tiers: dict[str, TierConfig]
    keys: list[ApiKey] = Field(default_factory=list)
    gateway: GatewayEdge = Field(default_factory=GatewayEdge)
    responses: ResponsesStore = Field(default_factory=ResponsesStore)  # POST /v1/responses' stored state
    replication: Replication = Field(default_factory=Replication)  # enqueues a replica acknowledged
    fair_line: FairLine = Field(default_factory=FairLine)  # how a fair tier shares a class among flows
    client_clock: ClientClock = Field(default_factory=ClientClock)  # the SDK's timeout and retries, read
    gpus: list[GpuInventory] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls, yaml_file=_yaml_path.get()))

    @model_validator(mode="after")
    def _aliases_unique(self) -> FleetConfig:
        """Cross-field checks: tiers exist, model names are unique, classes are known, leases outlast beats."""
        if not self.tiers:
            raise ValueError("at least one tier is required")
        for tier, tc in self.tiers.items():
            # A lease renewed every heartbeat must outlast the beat, or a healthy worker's
            # requests are reaped and run twice while it still serves them.
            if tc.lease_s <= self.heartbeat_s:
                raise ValueError(f"tiers.{tier}.lease_s ({tc.lease_s:g}) must be above heartbeat_s "
                                 f"({self.heartbeat_s:g}): workers renew their leases once a heartbeat")
            for msg in wait_limit_inversions(tc.wait_limit_s):
                warnings.warn(f"tiers.{tier}.wait_limit_s: {msg}: the class limits shed from the bottom, "
                              "so a higher class should never have the tighter limit", ConfigWarning, stacklevel=2)
        seen: dict[str, str] = {}
        for tier, tc in self.tiers.items():
            for name in [tier, *tc.aliases]:
                if name in seen and seen[name] != tier:
                    raise ValueError(f"model name {name!r} is used by tiers {seen[name]!r} and {tier!r}")
                seen[name] = tier
        if self.default_priority not in CLASSES:
            raise ValueError(f"unknown priority class {self.default_priority!r}; classes are {', '.join(CLASSES)}")
        names: set[str] = set()
        for i, k in enumerate(self.keys):
            if bad := k.unknown_tiers(self.tiers):
                raise ValueError(f"keys.{i}.tiers: no tier {', '.join(map(repr, bad))}; tiers are "
                                 f"{', '.join(self.tiers)}")
            if k.name in names:  # operators tell keys apart by name (revoke, logs)
                raise ValueError(f"keys.{i}.name: {k.name!r} is used by another key")
            names.add(k.name)
        return self

    @model_validator(mode="after")
    def _degrade_rules(self) -> FleetConfig:
        return degrade_checked(self, self.tiers)  # each message names its field

    def resolve_model(self, model: str) -> str | None:
        """The tier a request's `model` names, by tier name or alias."""
        if model in self.tiers:
            return model
        for tier, tc in self.tiers.items():
            if model in tc.aliases:
                return tier
        return None


def _describe(err: ErrorDetails) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "(top level)"
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or err["type"] == "missing" else f" (got {got!r})"
    return f"  {path}: {err['msg']}{shown}"


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> FleetConfig:
    """Load the config file (FLEET_CONFIG, else configs/fleet.yaml) plus env overrides."""
    p = Path(path or os.environ.get("FLEET_CONFIG") or DEFAULT_CONFIG)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (set FLEET_CONFIG or pass --config)")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping with a 'tiers' key")
    token = _yaml_path.set(p)
    try:
        return FleetConfig(**overrides)
    except ValidationError as e:
        lines = "\n".join(_describe(err) for err in e.errors())
        raise ConfigError(f"{p}: invalid config:\n{lines}") from None
    finally:
        _yaml_path.reset(token)
