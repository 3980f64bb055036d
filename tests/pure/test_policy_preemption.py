"""Which running calls a waiter could preempt: the gate a full replica's poll is judged by."""

from __future__ import annotations

from fleet.policy import RunningRequest, WaitingRequest, choose_victim, preemptible_below


def run(rank: int, *, sent: bool = False, preemptions: int = 0) -> RunningRequest:
    return RunningRequest(f"r{rank}{sent}{preemptions}", rank, progress=3, sent=sent, preemptions=preemptions)


def test_nothing_preemptible_once_every_call_has_sent_or_used_its_preemptions() -> None:
    running = [run(3, sent=True), run(2, preemptions=1), run(1, sent=True)]
    assert preemptible_below(running, max_preemptions=1) is None
    # ... and then no waiter, of any class, finds a victim: the gate agrees with the choice.
    for rank in range(4):
        assert choose_victim(running, WaitingRequest(rank, 10.0), free_for_waiter=0, max_preemptions=1,
                             min_wait_s=0.0) is None


def test_the_gate_is_the_lowest_class_still_preemptible() -> None:
    running = [run(3, sent=True), run(2), run(1)]
    assert preemptible_below(running, max_preemptions=1) == 2
    # A waiter above it finds a victim; one at it or below does not.
    assert choose_victim(running, WaitingRequest(1, 10.0), free_for_waiter=0, max_preemptions=1,
                         min_wait_s=0.0) == running[1]
    assert choose_victim(running, WaitingRequest(2, 10.0), free_for_waiter=0, max_preemptions=1,
                         min_wait_s=0.0) is None
    assert preemptible_below([], max_preemptions=1) is None
