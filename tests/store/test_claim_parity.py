"""The line's Lua claims take what the claim rule says (`fleet.policy.claim.choose_take`).

Hypothesis draws a line (classes, waits, deadlines, preemption marks, who holds each call's
prefix) and a replica (what it runs, the slots it keeps for higher classes); the real CLAIM or
AFFINE_CLAIM claims one slot on a private Redis, and the rule, given the same line, must name the
same call, drop the same ended calls on the way and leave calls for their holders alike."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.config import Priority
from fleet.policy import Holder, HoldRules, ReplicaView, Take, Waiting, caps_of, choose_take
from fleet.store.affinity import AffineLine, AffinityRules
from fleet.store.line import Line

SLOTS = 4
WAIT_MS = 1000  # each class's hold, here: a call that waited 3 s is due, one that waited 20 ms is not
SLACK_MS = 1000
LIVE_MS = 60_000
RULES = AffinityRules(window=3, wait_ms=(WAIT_MS,) * 4, slack_ms=SLACK_MS, live_ms=LIVE_MS)
HOLD = HoldRules(RULES.window, tuple(float(w) for w in RULES.wait_ms), RULES.slack_ms)
# The holder of a call's prefix as the rule sees it; "gone": a replica that stopped claiming long ago.
HOLDERS = {"me": Holder.MINE, "other": Holder.OTHER, "gone": Holder.NONE, "nobody": Holder.NONE, "": Holder.NONE}


@dataclass(frozen=True)
class Drawn:
    rank: int
    waited_ms: int
    left_ms: int  # <= 0: its deadline passed in the line
    holder: str  # '' : the call has no prefix
    marked: bool


calls_st = st.lists(
    st.builds(
        Drawn,
        rank=st.integers(0, 3),
        waited_ms=st.sampled_from([20, 3000]),
        left_ms=st.sampled_from([30_000, 30_000, 500, -1000]),
        holder=st.sampled_from(list(HOLDERS)),
        marked=st.booleans(),
    ),
    max_size=7,
)
reserved_st = st.sampled_from([{}, {0: 1}, {0: 1, 1: 1}, {0: 2}, {1: 2}])


async def build(base: Line, affine: bool, drawn: list[Drawn]) -> tuple[Line, list[list[Waiting]]]:
    """A fresh line holding `drawn`, in order; the rule's view of it (per class, in line order)."""
    ns = f"p{uuid.uuid4().hex[:8]}"
    opts = {"result_ttl_s": 30, "rate_window_s": 5}
    line = (
        AffineLine(base.redis, ns, "routing", rules=RULES, **opts)
        if affine
        else Line(base.redis, ns, "routing", **opts)
    )
    k, r = line.keys, line.redis
    sec, us = await r.time()
    now = int(sec) * 1000 + int(us) // 1000
    heads: list[list[Waiting]] = [[], [], [], []]
    for i, d in enumerate(drawn):
        rid = f"c{i}"
        key = f"k{i}" if d.holder else ""
        await line.enqueue(rid, Priority(d.rank), orjson.dumps({}), 60_000, affinity=key)
        fields = {"enq": now - d.waited_ms, "deadline": now + d.left_ms}
        if d.marked:
            fields["pmark"] = now
        await r.hset(k.request(rid), mapping=fields)
        if d.holder not in ("", "nobody"):
            await r.hset(k.affinity, key, d.holder)
        heads[d.rank].append(Waiting(rid, d.rank, d.waited_ms, d.left_ms, HOLDERS[d.holder], d.marked))
    await r.zadd(k.claimers, {"other": now, "gone": now - 10 * LIVE_MS})
    return line, heads


def rule_says(heads: list[list[Waiting]], replica: ReplicaView, hold: HoldRules | None) -> tuple[Take, set[str], float]:
    """One slot by the rule, as the Lua claims it: ended calls dropped on the way, then a take or none."""
    dropped: set[str] = set()
    retry = 0.0
    while True:
        take = choose_take(heads, replica, hold)
        if take.retry_ms > 0 and (retry == 0 or take.retry_ms < retry):
            retry = take.retry_ms
        if not take.drop:
            return take, dropped, retry
        assert take.call is not None
        dropped.add(take.call.rid)
        heads[take.call.rank].remove(take.call)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    drawn=calls_st, running=st.lists(st.integers(0, 3), max_size=SLOTS - 1), reserved=reserved_st, affine=st.booleans()
)
async def test_the_claim_lua_is_the_rule(
    line: Line, drawn: list[Drawn], running: list[int], reserved: dict[int, int], affine: bool
) -> None:
    fresh, heads = await build(line, affine, drawn)
    replica = ReplicaView(SLOTS, tuple(running), reserved)
    take, dropped, retry = rule_says(heads, replica, HOLD if affine else None)
    got = await fresh.claim("me", 1, 5, caps_of(replica))
    want = take.call.rid if take.call is not None else None
    assert [c.rid for c in got] == ([want] if want else []), (take, drawn)
    gone = {f"c{i}" for i in range(len(drawn)) if await fresh.redis.zscore(fresh.keys.line, f"c{i}") is None}
    assert gone == dropped | ({want} if want else set()), (take, drawn)  # the same ended calls dropped
    if affine:  # calls left for their holders alike, and due as soon (the clocks differ by the ms of the reads)
        assert (got.retry_s > 0) == (retry > 0), (take, drawn)
        assert abs(got.retry_s * 1000 - retry) <= 200
    await fresh.redis.delete(*[fresh.keys.request(f"c{i}") for i in range(len(drawn))], fresh.keys.line)
