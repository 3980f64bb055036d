"""The simulator's side of the claim rule (`fleet.policy.claim`): the line and a replica as the
rule sees them, in simulated time, and the affinity records the live claim keeps in Redis.

Live, each replica with a free slot claims from the line; here `Serving.dispatch` asks the rule,
for the least busy replica with a free slot first, what that replica takes, one slot at a time.
The views are built as the Lua reads Redis: the first calls of the best class waiting, each with
its wait, what is left to its deadline, its preemption mark and who holds its prefix (the replica
that last claimed a call of it, while that replica is live: it has a free slot or claimed within
`LIVE_MS`, as `fleet.store.affinity` counts a replica live).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from fleet.policy import victim_rank
from fleet.policy.claim import Holder, HoldRules, ReplicaView, Take, Waiting, caps_of, choose_take
from fleet.store.affinity import LIVE_MS
from simulator.state import QUEUED, Req, SimReplica, TierSim

LIVE_S = LIVE_MS / 1000

# The least busy replica first (a C-level key: dispatch sorts at every take).
_busy = attrgetter("running")


def free_replicas(tier: TierSim, slots: int) -> list[SimReplica]:
    """The ready replicas with a free slot, least busy first (a stable sort: ties keep the ready
    list's order)."""
    free = [r for r in tier.ready_list if r.running < slots]
    if len(free) > 1:
        free.sort(key=_busy)
    return free


def ranks_of(r: SimReplica, calls_on: dict[str, dict[Req, None]]) -> tuple[int, ...]:
    """The classes of the calls `r` runs, in the order they started (`calls_on`: replica id -> its
    calls); kept on the replica until they change (`SimReplica.ranks` None), not made per take."""
    ranks = r.ranks
    if ranks is None:
        ranks = r.ranks = tuple([c.call.cls for c in calls_on.get(r.id, ())])
    return ranks


def victim_candidates(tier: TierSim, calls_on: dict[str, dict[Req, None]], cls: int, most: int) -> dict[str, Req]:
    """The calls preemption may take a slot from for a waiting call of class `cls`, named as
    `choose_victim` reads them, in the order it reads them.

    Only the candidates (a lower class, fewer than `most` preemptions; the sim's calls have sent
    nothing to a caller): `choose_victim` drops the rest, and its pick among these, in the same
    order, is the same. In arrival order on each ready replica, named by it: a tie goes to the
    same call in every replay (not by address). And of those only the class `victim_rank` says
    `choose_victim` takes from, so its pick is among these anyway.
    """
    cands = [c for r in tier.ready_list
             for c in sorted((c for c in calls_on.get(r.id, ()) if c.call.cls > cls and c.preempted < most),
                             key=lambda c: c.lseq)]
    rank = victim_rank(c.call.cls for c in cands)
    return {str(c.lseq): c for c in cands if c.call.cls == rank}


def prefix_of(req: Req) -> object | None:
    """The prefix a call re-sends: its chain's, where the chain is one conversation; else none."""
    ch = req.chain
    return ch if ch is not None and ch.arrival.conversation else None


def hold_rules(tier: TierSim) -> HoldRules | None:
    """The tier's affinity hold as the rule takes it (None where affinity is off: the plain claim).
    Made once per tier: it depends only on the tier's configuration, and dispatch asks for it
    at every change of a replica's batch."""
    if not tier.affine:
        return None
    if tier.hold_rules is None:
        a = tier.tc.affinity
        tier.hold_rules = HoldRules(a.window, tuple(h * 1000 for h in tier.hold_s), a.slack_ms)
    return tier.hold_rules


def _holder(tier: TierSim, req: Req, r: SimReplica, t: float) -> Holder:
    key = prefix_of(req)
    rec = tier.holders.get(key) if key is not None else None
    if rec is None:
        return Holder.NONE
    h, at = rec
    if t - at > tier.tc.affinity.hold_s:
        del tier.holders[key]  # forgotten, as the live claim's upkeep forgets it
        return Holder.NONE
    if h is r:
        return Holder.MINE
    if h.state == "ready" and (h.running < tier.concurrency or t - h.claimed <= LIVE_S):
        return Holder.OTHER
    return Holder.NONE


def take_for(
    tier: TierSim, r: SimReplica, ranks: tuple[int, ...], hold: HoldRules | None, t: float
) -> tuple[Take, Req | None]:
    """What a free slot of `r` takes now (`fleet.policy.choose_take`), and that call. `ranks`: the
    classes of the calls `r` runs."""
    r.claimed = t
    by_class = tier.by_class
    best = next((c for c, n in enumerate(by_class) if n), None)
    if best is None:
        return Take(None, "empty"), None
    q = tier.line[best]
    reqs: list[Req] = [q[i] for i in range(min(len(q), hold.window if hold else 1))]
    none = Holder.NONE
    views = [
        Waiting(
            str(req.lseq),
            best,
            (t - req.t_arr) * 1000,
            (req.deadline - t) * 1000,
            # Only a call of a conversation has a prefix anyone holds (`prefix_of`).
            _holder(tier, req, r, t) if hold and req.chain is not None and req.chain.arrival.conversation else none,
            req.pmarked,
            req.state != QUEUED,
        )
        for req in reqs
    ]
    # Only the best class is read by the rule: the classes below it stay empty.
    heads: list[Sequence[Waiting]] = [()] * len(by_class)
    heads[best] = views
    view, caps = _replica_view(tier, ranks)
    take = choose_take(heads, view, hold, caps)
    if take.call is None:
        return take, None
    for i, v in enumerate(views):
        if v is take.call:
            return take, reqs[i]
    raise AssertionError("the rule took a call it was not shown")


def _replica_view(tier: TierSim, ranks: tuple[int, ...]) -> tuple[ReplicaView, tuple[int, ...] | None]:
    """The claiming replica as the rule sees it, and its class caps: the same for the same classes
    running, so made once per tier and `ranks` (both are immutable) rather than at every take."""
    got = tier.views.get(ranks)
    if got is None:
        # The slots a replica claims with are those its engine holds at once (`TierSim.concurrency`), as
        # the live worker claims: a 12-slot replica whose KV cache holds 8 typical calls claims 8.
        view = ReplicaView(tier.concurrency, ranks, tier.reserved)
        if len(tier.views) >= 4096:
            tier.views.clear()  # bounded: the mixes of classes a replica runs are few in practice
        got = tier.views[ranks] = (view, caps_of(view) if tier.reserved else None)
    return got


def remember(tier: TierSim, req: Req, r: SimReplica, t: float) -> None:
    """`r` took `req`: it holds the call's prefix now (the live claim's `remember`)."""
    key = prefix_of(req)
    if key is not None:
        tier.holders[key] = (r, t)
