"""Degrade before shedding, live: a call its tier refuses is judged for a smaller tier, and joins
that tier's line only if that tier's own admission admits it (docs/degrade.md).

Only a refusal pays for this: a call its tier admits never comes here, so it costs nothing on
the hot path. The decision of where to go next is the policy's (`fleet.policy.degrade.next_tier`,
which the simulator asks too); each target is judged by the whole admission sequence of that
tier (the key's rate and dollar reservations at the target's price, its class limits, deadline
and budget), with the retry gate left out (the attempt passed it where it asked). When no target
admits it, the caller gets the first refusal, unchanged.

A degraded call is counted in `fleet_degraded_total{from, to, reason, class}` and in both
tiers' line counters (`degraded_out`, `degraded_in`), which the status page reads.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Protocol

from redis.asyncio import Redis

from fleet import metrics
from fleet.degrade_config import Degrade
from fleet.policy.degrade import DegradeAsk, next_tier
from fleet.store.keys import TierKeys
from fleet.tasks import spawn
from gateway.errors import APIError
from gateway.tickets import AdmissionRequest, Ticket

log = logging.getLogger("fleet.gateway.admission")

DEGRADED_OUT, DEGRADED_IN = "degraded_out", "degraded_in"  # the line counters' fields (status)


class Retarget(Protocol):
    """What the call knows of itself that admission does not: who may say it degrades, and the
    same call as the target tier would carry it (its output estimate and fair place there)."""

    def ask(self, reason: str) -> DegradeAsk:
        """The call as its tier refused it for `reason`."""

    def request(self, first: AdmissionRequest, tier: str, reason: str) -> AdmissionRequest | None:
        """The same call for `tier` (None: that tier cannot take it, e.g. its max_tokens is over
        the tier's limit)."""


Admit = Callable[[AdmissionRequest], Awaitable[Ticket]]


async def degraded(first: AdmissionRequest, refused: APIError, retarget: Retarget, rules: Mapping[str, Degrade | None],
                   admit_at: Admit, redis: Redis, namespace: str) -> Ticket | None:
    """The ticket of the tier that admits the call instead, or None: the caller is told `refused`.
    `admit_at` runs one tier's whole admission (raising its typed refusal)."""
    if refused.status != 429 or not refused.code:
        return None
    ask = retarget.ask(refused.code)
    while (to := next_tier(ask, rules)) is not None:
        req = retarget.request(first, to, refused.code)
        if req is None:
            return None
        try:
            ticket = await admit_at(req)
        except APIError as e:
            if e.status != 429 or not e.code:
                return None
            ask = replace(ask, tier=to, reason=e.code, came_from=(*ask.came_from, ask.tier))
            continue
        metrics.DEGRADED.labels(first.tier, to, refused.code, first.priority.name).inc()
        spawn(_count(redis, namespace, first.tier, to))
        return ticket
    return None


async def _count(redis: Redis, namespace: str, asked: str, to: str) -> None:
    """Both tiers' counters (status: degraded out and in); off the caller's path, and a blip only
    loses a count."""
    try:
        await redis.hincrby(TierKeys(namespace, asked).counters, DEGRADED_OUT, 1)
        await redis.hincrby(TierKeys(namespace, to).counters, DEGRADED_IN, 1)
    except Exception:
        log.warning("could not count a degraded call (%s -> %s)", asked, to, exc_info=True)
