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

from fleet.policy.claim import Holder, HoldRules, ReplicaView, Take, Waiting, caps_of, choose_take
from fleet.store.affinity import LIVE_MS
from simulator.state import QUEUED, Req, SimReplica, TierSim

LIVE_S = LIVE_MS / 1000


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
    best = next((c for c, n in enumerate(tier.by_class) if n), None)
    if best is None:
        return Take(None, "empty"), None
    q = tier.line[best]
    reqs: list[Req] = []
    for i in range(min(len(q), hold.window if hold else 1)):
        reqs.append(q[i])
    views = [
        Waiting(
            str(req.lseq),
            best,
            (t - req.t_arr) * 1000,
            (req.deadline - t) * 1000,
            _holder(tier, req, r, t) if hold else Holder.NONE,
            req.pmarked,
            req.state != QUEUED,
        )
        for req in reqs
    ]
    # Only the best class is read by the rule: the classes below it stay empty.
    heads: list[Sequence[Waiting]] = [()] * len(tier.by_class)
    heads[best] = views
    # The slots a replica claims with are those its engine holds at once (`TierSim.concurrency`), as
    # the live worker claims: a 12-slot replica whose KV cache holds 8 typical calls claims 8.
    view = ReplicaView(tier.concurrency, ranks, tier.reserved)
    take = choose_take(heads, view, hold, caps_of(view) if tier.reserved else None)
    if take.call is None:
        return take, None
    for i, v in enumerate(views):
        if v is take.call:
            return take, reqs[i]
    raise AssertionError("the rule took a call it was not shown")


def remember(tier: TierSim, req: Req, r: SimReplica, t: float) -> None:
    """`r` took `req`: it holds the call's prefix now (the live claim's `remember`)."""
    key = prefix_of(req)
    if key is not None:
        tier.holders[key] = (r, t)
