"""The priority classes, and the settings given per class: `preemption:` and `affinity:` of a tier.

Kept apart from `fleet.config` (which imports and re-exports all of it) so the
config module stays small; nothing here imports another fleet module.
"""

from __future__ import annotations

from enum import IntEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Priority(IntEnum):
    """Priority classes; a lower value is served first and shed last."""

    committed = 0
    interactive = 1
    speculative = 2
    background = 3

    @classmethod
    def parse(cls, name: str) -> Priority:
        return cls[name.strip().lower()]


CLASSES: tuple[str, ...] = tuple(p.name for p in Priority)


def known_classes(names: list[str]) -> list[str]:
    """Class names a config lists, each a known class; a ValueError names the first that is not."""
    for name in names:
        if name not in CLASSES:
            raise ValueError(f"unknown priority class {name!r}; classes are {', '.join(CLASSES)}")
    return names


def per_class_positive(v: dict[str, float], what: str) -> dict[str, float]:
    """A per-class mapping: known class names, positive values; a ValueError names the bad one."""
    known_classes(list(v))
    for name, value in v.items():
        if value <= 0:
            raise ValueError(f"{what} for {name!r} must be > 0")
    return v


class Preemption(BaseModel):
    """Higher classes taking a full tier's slots from lower ones (`fleet.policy.preemption`, docs/preemption.md)."""

    model_config = ConfigDict(extra="forbid")  # as every config section: a typo is named, not ignored

    # On by default: "committed is served" must hold for a config that never mentions preemption.
    enabled: bool = True
    # Per request; after that it runs to the end, so nothing starves. Two, not one: a steady
    # flow of committed calls would otherwise soon find every background request at its limit.
    max_preemptions: int = Field(2, ge=0)
    # A waiter this young may still be claimed by a replica with a free slot (a claim takes a few
    # ms; 25 leaves room for a loaded box without a needless preemption, and costs a TTFT of 25 ms).
    min_wait_ms: int = Field(25, ge=0)
    poll_ms: int = Field(20, gt=0)  # how often a full replica looks for a higher class waiting
    reserved_slots: dict[str, int] = Field(default_factory=dict)  # per replica, kept for this class and above

    @field_validator("reserved_slots")
    @classmethod
    def _known(cls, v: dict[str, int]) -> dict[str, int]:
        return {k: int(n) for k, n in per_class_positive(v, "reserved slots").items()}  # type: ignore[arg-type]


class Affinity(BaseModel):
    """Claims that prefer the calls whose prefix a replica has cached (`fleet.store.affinity`,
    docs/prefix-affinity.md). Class order, deadlines and preemption come first, always."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # A claim looks at the first `window` calls of the best class waiting, in the line's order.
    window: int = Field(8, ge=1, le=64)
    # How long a call whose prefix another live replica holds waits for that replica before any
    # replica takes it: per class, in ms; a class not given waits `wait_fraction` of its wait
    # limit, at most `max_wait_ms` (a prefill saved is worth tens of ms, not seconds of wait).
    wait_ms: dict[str, int] = Field(default_factory=dict)
    wait_fraction: float = Field(0.01, ge=0, le=0.5)
    max_wait_ms: int = Field(50, ge=0)
    # A call with less than this left before its deadline is never passed over or held back.
    slack_ms: int = Field(1000, ge=0)
    # A prefix served longer ago than this counts as gone from the replica's cache.
    hold_s: float = Field(600.0, gt=0)
    max_keys: int = Field(10000, gt=0)  # prefixes remembered per tier (oldest forgotten first)

    @field_validator("wait_ms")
    @classmethod
    def _known(cls, v: dict[str, int]) -> dict[str, int]:
        for name, ms in v.items():
            if name not in CLASSES:
                raise ValueError(f"unknown priority class {name!r}; classes are {', '.join(CLASSES)}")
            if ms < 0:
                raise ValueError(f"wait for {name!r} must be >= 0")
        return {k: int(ms) for k, ms in v.items()}

    def waits_ms(self, wait_limit_s: dict[str, float]) -> tuple[int, ...]:
        """The hold per class rank (highest class first), from `wait_ms` or the class's wait limit."""
        return tuple(self.wait_ms.get(c, int(min(self.max_wait_ms, self.wait_fraction * 1000
                                                  * wait_limit_s.get(c, self.max_wait_ms)))) for c in CLASSES)


class Replication(BaseModel):
    """`replication:` of the config: a call is acknowledged to its caller only once a replica of
    its Redis has it (`WAIT`, `fleet.store.replication`), where that Redis has replicas at all."""

    model_config = ConfigDict(extra="forbid")

    # Replicas that must hold an enqueue before the call goes on; 0 never waits.
    ack_replicas: int = Field(1, ge=0)
    # The longest an enqueue waits for them; past it the call is served anyway (and counted).
    ack_timeout_ms: int = Field(100, gt=0)
    ack_classes: list[str] = Field(default_factory=lambda: list(CLASSES))  # the classes that wait

    @field_validator("ack_classes")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        return known_classes(v)

    def waits(self, priority: str) -> bool:
        return self.ack_replicas > 0 and priority in self.ack_classes


class FairLine(BaseModel):
    """`fair_line:` of the config: how a tier's line shares each class among its flows
    (`fleet.policy.fairness`, docs/fair-line.md). A tier chooses `fairness: fair` or `fifo`."""

    model_config = ConfigDict(extra="forbid")

    # A flow's service is its tokens: input plus output, output counted this many times (a decoded
    # token costs an engine several prefilled ones; llm-d's program-aware order uses 2 as well).
    output_weight: float = Field(2.0, ge=0)
    # How fast a flow that stopped waiting is forgiven what it was served beyond the others.
    half_life_s: float = Field(60.0, gt=0)
    # Headers agent clients send that name a session; a call's flow is its X-Chain-Id, else the
    # first of these it carries, else its API key, else its client address.
    session_headers: list[str] = Field(default_factory=lambda: ["x-session-id", "x-session-affinity",
                                                                   "x-claude-code-session-id"])
    # A chain (X-Chain-Id) with no call open for this long is counted complete (status, metrics).
    chain_idle_s: float = Field(30.0, gt=0)

    @field_validator("session_headers")
    @classmethod
    def _lower(cls, v: list[str]) -> list[str]:
        for h in v:
            if not h or not all(c.isalnum() or c in "-_" for c in h):
                raise ValueError(f"session header {h!r} is not a header name (letters, digits, - and _)")
        return [h.lower() for h in v]
