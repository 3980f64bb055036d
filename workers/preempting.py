"""A replica's side of preemption: what it runs, as the victim choice sees it, and the
preempting itself when it is full and a higher class waits (docs/preemption.md).

The decision is `fleet.policy.choose_victim`; the line's PREEMPT script makes it
stick once per waiting call across replicas. This module only gathers the inputs
and carries the result out: the victim's attempt is aborted in the engine (its
task cancelled) and its tokens are not charged, since it runs again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fleet.config import Priority, TierConfig
from fleet.policy import RunningRequest, WaitingRequest, choose_victim, claim_caps, preemptible_below
from fleet.store.line import Claimed, Line


def attempt_rank(priority: str) -> int:
    """A class name's rank (0 committed .. 3 background); an unknown name ranks as background."""
    return int(Priority[priority]) if priority in Priority.__members__ else int(Priority.background)


@dataclass(slots=True)
class Attempt:
    """One running attempt, updated by its `_serve` task as tokens come."""

    lease: str
    owner: str
    rank: int
    preemptions: int
    started: float = field(default_factory=time.monotonic)
    progress: int = 0
    sent: bool = False  # a stream pushed text: it may be on its way to the caller


class Preemptor:
    """Per replica: the attempts it runs, the claim caps (reserved slots), and `check`."""

    def __init__(self, line: Line, tc: TierConfig, replica_id: str) -> None:
        self.line = line
        self.settings = tc.preemption
        self.replica_id = replica_id
        # A mark older than a lease: the replica that made room never claimed (it died); try again.
        self.stale_s = tc.lease_s
        self.reserved = {int(Priority[c]): n for c, n in tc.preemption.reserved_slots.items()}
        self.attempts: dict[str, Attempt] = {}  # rid -> the attempt running here
        self.preempted: set[str] = set()  # leases preempted here, whose tasks are ending

    @property
    def enabled(self) -> bool:
        return self.settings.enabled and self.settings.max_preemptions > 0

    @property
    def poll_s(self) -> float:
        return self.settings.poll_ms / 1000

    def track(self, c: Claimed) -> Attempt:
        a = Attempt(lease=c.lease, owner=c.owner, rank=attempt_rank(c.priority), preemptions=c.preempted)
        self.attempts[c.rid] = a
        return a

    def untrack(self, rid: str, a: Attempt) -> bool:
        """Forget the attempt; True if it ended because it was preempted here."""
        if self.attempts.get(rid) is a:
            del self.attempts[rid]
        was = a.lease in self.preempted
        self.preempted.discard(a.lease)
        return was

    def caps(self, concurrency: int) -> tuple[int, ...] | None:
        """What each class may still claim here (None: no reservations, the free slots for all)."""
        if not self.reserved:
            return None
        return claim_caps(concurrency, [a.rank for a in self.attempts.values()], self.reserved)

    def running(self, active: dict[str, asyncio.Task[None]]) -> list[RunningRequest]:
        """What runs here, as the victim choice sees it (not the attempts already preempted)."""
        return [RunningRequest(rid, a.rank, a.progress, a.sent, a.preemptions, a.started)
                for rid, a in self.attempts.items() if rid in active and a.lease not in self.preempted]

    def could_preempt(self, active: dict[str, asyncio.Task[None]]) -> bool:
        """Anything running here may still be preempted (`fleet.policy.preemptible_below`): while
        not, a full replica has nothing to poll the line for until a slot frees."""
        return preemptible_below(self.running(active), max_preemptions=self.settings.max_preemptions) is not None

    async def check(self, concurrency: int, active: dict[str, asyncio.Task[None]]) -> bool:
        """Full: preempt one running request for the highest class waiting, if the policy says so.

        Returns True when a victim was preempted and its task has ended (its slot is free).
        """
        running = self.running(active)
        below = preemptible_below(running, max_preemptions=self.settings.max_preemptions)
        if below is None:  # nothing here may be preempted: no round trip to look
            return False
        waiter = await self.line.peek_waiter(below, stale_s=self.stale_s)  # only a class above could
        if waiter is None:
            return False
        caps = self.caps(concurrency)
        free = caps[waiter.rank] if caps else concurrency - len(active)
        victim = choose_victim(running, WaitingRequest(waiter.rank, waiter.waited_s), free_for_waiter=free,
                               max_preemptions=self.settings.max_preemptions,
                               min_wait_s=self.settings.min_wait_ms / 1000)
        if victim is None:
            return False
        a = self.attempts[victim.rid]
        if not await self.line.preempt(waiter.rid, victim.rid, a.owner,
                                       max_preemptions=self.settings.max_preemptions, stale_s=self.stale_s):
            return False
        self.preempted.add(a.lease)
        task = active.get(victim.rid)
        if task is not None:
            task.cancel()  # its _serve aborts it in the engine
            await asyncio.wait({task})
        return True
