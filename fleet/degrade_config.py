"""Where a tier's calls degrade to when it cannot serve them: a tier's `degrade:` block (docs/degrade.md).

    degrade: {to: analysis, classes: [speculative, background],
              on: [budget_exhausted, drain_exceeded, deadline_unmeetable]}

A call this tier would refuse for one of the `on` reasons is judged for the tier `to` by that
tier's own rules, and served there only if that tier would admit it (`fleet.policy.degrade`).
Checked at start-up (`degrade_problems`, through `degrade_checked` in `fleet.config.FleetConfig`): the target
exists and is another tier, the tiers' `to` make no cycle, and `pinned` names are this tier's
own model names. A call degrades at most once; a second hop, from the tier it degraded into,
only where that tier's rule says `chain: true`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, TypeVar

from pydantic import Field, field_validator, model_validator

from fleet.classes import known_classes
from fleet.engine_config import _Strict

# The admission refusals a tier may degrade on: the words of `fleet.policy.admission.Reason`.
DegradeReason = Literal["budget_exhausted", "drain_exceeded", "deadline_unmeetable"]
DEGRADE_REASONS: tuple[DegradeReason, ...] = ("budget_exhausted", "drain_exceeded", "deadline_unmeetable")
# A call's wish (`X-Fleet-Degrade`), and an API key's rule for its calls: `tier` follows the
# tier's rule, `allow`/`never` are the key's default (a header overrides it), `forbid` is never,
# whatever the header says.
DegradeWish = Literal["allow", "never"]
KeyDegrade = Literal["tier", "allow", "never", "forbid"]


class Degrade(_Strict):
    """One tier's degrade rule."""

    to: str = Field(min_length=1)  # the tier that serves the call instead
    # Classes that degrade by the tier's rule; `committed` only if listed here (never by default).
    classes: list[str] = Field(default_factory=lambda: ["speculative", "background"])
    on: list[DegradeReason] = Field(default_factory=lambda: list(DEGRADE_REASONS), min_length=1)
    # A call that degraded INTO this tier may degrade on from it by this rule (a chain of tiers).
    chain: bool = False
    # Model names (this tier's name or its aliases) the operator pinned: a call naming one is
    # never degraded (`degrade: never` on that alias).
    pinned: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `on:` key as the boolean true: it is this rule's `on`.
        if isinstance(v, dict) and True in v:
            v = {("on" if k is True else k): x for k, x in v.items()}
        return v

    @field_validator("classes")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        return known_classes(v)


class _Tier(Protocol):
    @property
    def degrade(self) -> Degrade | None: ...

    @property
    def aliases(self) -> list[str]: ...


def degrade_problems(tiers: Mapping[str, _Tier]) -> list[str]:
    """What is wrong with the tiers' degrade rules, each message naming its field; [] when none."""
    out: list[str] = []
    for tier, tc in tiers.items():
        d = tc.degrade
        if d is None:
            continue
        if d.to not in tiers:
            out.append(f"tiers.{tier}.degrade.to: no tier {d.to!r}; tiers are {', '.join(tiers)}")
        elif d.to == tier:
            out.append(f"tiers.{tier}.degrade.to: a tier cannot degrade to itself")
        names = {tier, *tc.aliases}
        for p in d.pinned:
            if p not in names:
                out.append(f"tiers.{tier}.degrade.pinned: {p!r} is not a model name of this tier "
                           f"({', '.join(sorted(names))})")
    if not out:
        out.extend(_cycles({t: tc.degrade.to for t, tc in tiers.items() if tc.degrade is not None}))
    return out


T = TypeVar("T")


def degrade_checked(cfg: T, tiers: Mapping[str, _Tier]) -> T:
    """`cfg` itself, or a ValueError naming every bad degrade field (`degrade_problems`)."""
    if bad := degrade_problems(tiers):
        raise ValueError("; ".join(bad))
    return cfg


def _cycles(edges: Mapping[str, str]) -> list[str]:
    """Each cycle of `to` edges once, named from its first tier in config order."""
    seen: set[str] = set()
    out: list[str] = []
    for start in edges:
        path: list[str] = []
        t: str | None = start
        while t is not None and t not in seen and t not in path:
            path.append(t)
            t = edges.get(t)
        if t is not None and t in path:
            loop = [*path[path.index(t):], t]
            out.append(f"tiers.{loop[0]}.degrade.to: the degrade rules make a cycle ({' -> '.join(loop)})")
        seen.update(path)
    return out

