"""Degrade before shedding: which smaller tier may serve a call its own tier would refuse. Pure; no I/O.

A tier's `degrade:` rule (`fleet.degrade_config.Degrade`) names the tier its calls go to, for
which classes and on which refusals. When admission would refuse a call for one of those
reasons, the call is judged for the target tier by that tier's own admission (its class
limits, deadline, budget, and the key's limits there), and served there only if admitted; else
its caller gets the first refusal, unchanged (docs/degrade.md).

`next_tier` is the one decision: the gateway asks it for each hop, after a real admission at
the target (`gateway.degrade`); the simulator and the tests ask `degrade`, which runs the same
hops with a judge of their own. What always holds (tests/pure/test_degrade.py):

- a `committed` call degrades only where the tier's rule lists `committed`;
- a call degrades at most once, unless the tier it degraded into says `chain: true`, and never
  back into a tier it came from;
- it is served only where the target's own admission admits it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from fleet.classes import Priority
from fleet.degrade_config import DEGRADE_REASONS, Degrade, DegradeWish, KeyDegrade


@dataclass(frozen=True, slots=True)
class DegradeAsk:
    """One call its tier `tier` would refuse for `reason`, and who may say whether it degrades."""

    tier: str  # the tier that would refuse it now
    reason: str  # that tier's refusal (an admission `Reason`, or another refusal's code)
    priority: Priority
    model: str = ""  # the model name the call named (a pinned alias is never degraded)
    wish: DegradeWish | None = None  # `X-Fleet-Degrade`
    key: KeyDegrade = "tier"  # its API key's rule (`ApiKey.degrade`)
    key_tiers: frozenset[str] | None = None  # the tiers its key may use; None: all
    came_from: tuple[str, ...] = ()  # the tiers it already degraded from, first asked first

    @property
    def asked(self) -> str:
        """The tier the caller asked for."""
        return self.came_from[0] if self.came_from else self.tier


@dataclass(frozen=True, slots=True)
class Degraded:
    """The call is served by `to` instead of `asked`, which refused it for `reason`."""

    asked: str
    to: str
    reason: str  # the asked tier's refusal
    hops: int = 1


def will(wish: DegradeWish | None, key: KeyDegrade) -> str:
    """`allow`, `never` or `tier` (the tier's rule decides): a key's `forbid` wins over any header,
    a header over the key's default."""
    if key == "forbid":
        return "never"
    if wish is not None:
        return wish
    return key if key in ("allow", "never") else "tier"


def next_tier(ask: DegradeAsk, rules: Mapping[str, Degrade | None]) -> str | None:
    """The tier to judge this call for next, or None: it is refused as its tier said.

    `rules`: each tier's degrade rule (None: it degrades nothing). `X-Fleet-Degrade: allow` (or
    the key's `allow`) lifts the rule's class list, except for `committed`, which degrades only
    where the operator listed it; `never` (or the key's `never`/`forbid`, or a pinned model
    name) keeps the call where it asked."""
    rule = rules.get(ask.tier)
    if rule is None or ask.reason not in DEGRADE_REASONS or ask.reason not in rule.on:
        return None
    if ask.came_from and not rule.chain:  # at most once, unless the tier it degraded into chains
        return None
    first = rules.get(ask.asked)
    if first is not None and ask.model in first.pinned:
        return None
    w = will(ask.wish, ask.key)
    if w == "never":
        return None
    listed = ask.priority.name in rule.classes
    if not listed and (w != "allow" or ask.priority == Priority.committed):
        return None
    to = rule.to
    if to == ask.tier or to in ask.came_from or to not in rules:
        return None
    if ask.key_tiers is not None and to not in ask.key_tiers:
        return None
    return to


def rules_of(tiers: Mapping[str, object]) -> dict[str, Degrade | None]:
    """Each tier's degrade rule, from a config's tiers (anything with a `degrade` attribute)."""
    return {t: getattr(tc, "degrade", None) for t, tc in tiers.items()}


# A judge answers whether `tier` would admit the call now, and if not, its refusal's reason.
Judge = Callable[[str], "tuple[bool, str]"]


def degrade(ask: DegradeAsk, rules: Mapping[str, Degrade | None], judge: Judge) -> Degraded | None:
    """Where the call is served instead, or None (refused with its first refusal): each hop asks
    `next_tier`, then the target's own admission (`judge`); the gateway runs the same hops with
    a real admission at each target (`gateway.degrade`)."""
    asked, reason = ask.tier, ask.reason
    hops = 0
    while (to := next_tier(ask, rules)) is not None:
        hops += 1
        admitted, why = judge(to)
        if admitted:
            return Degraded(asked, to, reason, hops)
        ask = replace(ask, tier=to, reason=why, came_from=(*ask.came_from, ask.tier))
    return None
