"""The claim rule (`fleet.policy.claim.choose_take`): what one free slot of a replica takes."""

from __future__ import annotations

from fleet.policy import Holder, HoldRules, ReplicaView, Waiting, choose_take

HOLD = HoldRules(window=3, wait_ms=(50, 40, 40, 40), slack_ms=1000)
FREE = ReplicaView(slots=4)


def call(
    rid: str,
    rank: int = 1,
    *,
    waited: float = 0,
    left: float = 30_000,
    holder: Holder = Holder.NONE,
    marked: bool = False,
) -> Waiting:
    return Waiting(rid, rank, waited, left, holder, marked)


def lines(*calls: Waiting) -> list[list[Waiting]]:
    heads: list[list[Waiting]] = [[], [], [], []]
    for c in calls:
        heads[c.rank].append(c)
    return heads


def test_the_highest_class_goes_first() -> None:
    take = choose_take(lines(call("bg", 3), call("i", 1)), FREE)
    assert take.call is not None and take.call.rid == "i" and take.reason == "head"


def test_an_empty_line_or_a_full_replica_takes_nothing() -> None:
    assert choose_take(lines(), FREE).reason == "empty"
    assert choose_take(lines(call("a")), ReplicaView(2, (1, 1))).reason == "full"


def test_a_reserved_slot_is_kept_for_the_class_above() -> None:
    """One slot of four kept for committed: three interactive running leave the last one free
    for committed only, and the line's interactive head waits (nothing below it goes either)."""
    kept = ReplicaView(4, (1, 1, 1), {0: 1})
    take = choose_take(lines(call("i", 1), call("bg", 3)), kept)
    assert take.call is None and take.reason == "capped"
    take = choose_take(lines(call("c", 0), call("i", 1)), kept)
    assert take.call is not None and take.call.rid == "c"


def test_a_used_reservation_frees_the_slot_for_the_rest() -> None:
    """The committed call running uses the reservation: the other free slot is anyone's."""
    take = choose_take(lines(call("i", 1)), ReplicaView(4, (0, 1, 1), {0: 1}))
    assert take.call is not None and take.call.rid == "i"


def test_a_call_past_its_deadline_is_dropped() -> None:
    take = choose_take(lines(call("dead", left=0), call("next")), FREE)
    assert take.drop and take.call is not None and take.call.rid == "dead"


def test_own_prefix_goes_ahead_of_an_older_call_of_the_class() -> None:
    take = choose_take(lines(call("old"), call("mine", holder=Holder.MINE)), FREE, HOLD)
    assert take.call is not None and take.call.rid == "mine" and take.reason == "own_prefix"


def test_a_due_call_is_never_passed_over() -> None:
    for due in (call("due", waited=40), call("due", left=900), call("due", marked=True)):
        take = choose_take(lines(due, call("mine", holder=Holder.MINE)), FREE, HOLD)
        assert take.call is not None and take.call.rid == "due" and take.reason == "due"


def test_a_call_held_for_another_replica_waits_its_hold() -> None:
    take = choose_take(lines(call("theirs", waited=10, holder=Holder.OTHER), call("free")), FREE, HOLD)
    assert take.call is not None and take.call.rid == "free" and take.reason == "unheld"
    assert take.retry_ms == 30  # "theirs" is anyone's in 30 ms
    take = choose_take(lines(call("theirs", holder=Holder.OTHER), call("bg", 3)), FREE, HOLD)
    assert take.call is None and take.reason == "held" and take.retry_ms == 40  # nothing lower goes ahead


def test_the_first_unheld_call_goes_before_a_due_one_behind_it() -> None:
    take = choose_take(lines(call("free"), call("due", waited=100)), FREE, HOLD)
    assert take.call is not None and take.call.rid == "free"


def test_only_the_window_is_looked_at() -> None:
    held = [call(f"h{i}", holder=Holder.OTHER) for i in range(3)]
    take = choose_take(lines(*held, call("mine", holder=Holder.MINE)), FREE, HOLD)
    assert take.call is None and take.reason == "held"


def test_its_own_prefix_never_goes_ahead_of_a_higher_class() -> None:
    take = choose_take(lines(call("c", 0), call("mine", 3, holder=Holder.MINE)), FREE, HOLD)
    assert take.call is not None and take.call.rid == "c"
