"""The claim rule: what one free slot of a replica takes from its tier's line.

One rule for the live line and its replay. The line's Lua claims (`fleet.store.line_scripts.CLAIM`,
`fleet.store.affinity.AFFINE_CLAIM`) apply it in Redis, one slot after another; the simulator
calls `choose_take` for every take. `tests/store/test_claim_parity.py` holds the Lua to it.

For one slot:

1. class order: only the highest class waiting is looked at; a lower class never goes ahead of it,
   whatever holds that class back;
2. class caps and reserved slots: a class over its cap on this replica (`claim_caps`: the slots
   kept for the classes above it, less what they run here) takes nothing, and the claim stops;
3. without affinity: the head of that class;
4. with affinity (`HoldRules`), among the first `window` calls of that class in line order:
   a call of a prefix this replica holds, unless a call ahead of it is due; else the first call no
   other live replica holds, or that is due; else nothing, and the calls looked at wait for their
   holders (`retry_ms`: when the first of them is due). A call is due once it waited its class's
   hold, has at most `slack_ms` left, or a replica preempted for it: a due call is never passed
   over nor held back.

A call whose deadline passed in the line (or which ended there) is dropped when the rule meets it
(`Take.drop`): it leaves the line, taken by no one, and the slot looks again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from fleet.policy.preemption import claim_caps

Reason = Literal["empty", "full", "capped", "held", "ended", "head", "own_prefix", "unheld", "due"]


class Holder(Enum):
    """Who holds a call's prefix (the replica that last claimed a call of it, while live)."""

    NONE = "none"  # no prefix, nobody holds it, or its holder is gone (drained, dead, stale)
    MINE = "mine"  # the replica claiming: its cache has the prefix
    OTHER = "other"  # another live replica


@dataclass(frozen=True, slots=True)
class Waiting:
    """One call in the line, as the claim sees it."""

    rid: str
    rank: int  # its class (Priority value): 0 committed ... 3 background
    waited_ms: float  # since it joined the line
    left_ms: float  # to its deadline; <= 0: it ended in the line
    holder: Holder = Holder.NONE
    marked: bool = False  # a replica preempted for it (`pmark`)
    ended: bool = False  # it left the line's protocol already (its hash gone, not queued)


@dataclass(frozen=True, slots=True)
class HoldRules:
    """The affinity hold of a tier (`fleet.store.affinity.AffinityRules`, its claim's part)."""

    window: int
    wait_ms: tuple[float, ...]  # per class rank: how long a call waits for its holder
    slack_ms: float  # a call with this little left to its deadline waits for no one


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """The replica claiming: its slots, the classes (ranks) it runs now, its reserved slots."""

    slots: int
    running: tuple[int, ...] = ()
    reserved: Mapping[int, int] | None = None  # rank -> slots kept for it and the classes above


@dataclass(frozen=True, slots=True)
class Take:
    """What one slot does. `call` None: it takes nothing now (`reason` says why). `drop`: the
    call ended in the line and leaves it untaken; the slot looks again. `retry_ms` > 0: calls
    were left for their holders and are anyone's in that long."""

    call: Waiting | None
    reason: Reason
    drop: bool = False
    retry_ms: float = 0.0


def caps_of(replica: ReplicaView) -> tuple[int, ...] | None:
    """What each class may still claim on `replica` (None: no reservations, its free slots for all)."""
    if not replica.reserved:
        return None
    return claim_caps(replica.slots, replica.running, replica.reserved)


def choose_take(
    heads: Sequence[Sequence[Waiting]],
    replica: ReplicaView,
    hold: HoldRules | None = None,
    caps: tuple[int, ...] | None = None,
) -> Take:
    """What one free slot of `replica` takes, by the rule in the module doc.

    `heads`: per class rank, its first calls in line order (at least `hold.window` of them with a
    hold, the first one without). Only the highest class waiting is read, so a caller may leave the
    classes below it empty. `caps`: `caps_of(replica)`, where the caller has it already.
    """
    if len(replica.running) >= replica.slots:
        return Take(None, "full")
    rank = next((r for r, calls in enumerate(heads) if calls), None)
    if rank is None:
        return Take(None, "empty")
    cap = caps if caps is not None else caps_of(replica)
    if cap is not None and cap[rank] <= 0:
        return Take(None, "capped")  # its free slots are kept for the classes above it
    calls = heads[rank]
    if hold is None:
        head = calls[0]
        return Take(head, "ended", drop=True) if _ended(head) else Take(head, "head")
    return _affine(calls[: hold.window], hold.wait_ms[rank], hold.slack_ms)


def _ended(c: Waiting) -> bool:
    return c.ended or c.left_ms <= 0


def _affine(calls: Sequence[Waiting], wait_ms: float, slack_ms: float) -> Take:
    """The affine pick among `calls` (the window of the best class): AFFINE_CLAIM's `choose`."""
    first: Waiting | None = None
    retry = 0.0
    for c in calls:
        if _ended(c):
            return Take(first, "unheld", retry_ms=retry) if first else Take(c, "ended", drop=True, retry_ms=retry)
        if c.holder is Holder.MINE:
            return Take(c, "own_prefix", retry_ms=retry)
        if c.waited_ms >= wait_ms or c.left_ms <= slack_ms or c.marked:
            return Take(first, "unheld", retry_ms=retry) if first else Take(c, "due", retry_ms=retry)
        if c.holder is Holder.OTHER:
            due = wait_ms - c.waited_ms
            retry = due if retry == 0 or due < retry else retry
        elif first is None:
            first = c
    if first is not None:
        return Take(first, "unheld", retry_ms=retry)
    return Take(None, "held", retry_ms=retry)


__all__ = ["HoldRules", "Holder", "ReplicaView", "Take", "Waiting", "caps_of", "choose_take"]
